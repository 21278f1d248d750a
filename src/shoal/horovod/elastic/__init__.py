"""`hvd.elastic`: Horovod's elastic training API on shoal's restarts.

  restart.py  run: the decorated function resumes from the newest commit after the launcher restarts the job
  state.py    State, ObjectState, TorchState: commit / restore / sync, reset callbacks
  commits.py  where commits live on disk (one folder per launch), written atomically, read without unpickling
  sampler.py  ElasticSampler: the rest of an epoch split over the processes there are
"""

from shoal.horovod.elastic.restart import run
from shoal.horovod.elastic.sampler import ElasticSampler
from shoal.horovod.elastic.state import ObjectState, State, TorchState

__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "run"]
