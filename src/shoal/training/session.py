"""`shoal.Session`: shoal inside your own training loop.

    sess = shoal.Session("cfg.toml")                  # or keyword sections: Session(parallel={"zero": 3})
    model, optimizer = sess.prepare(model, optimizer)  # the config's layout: DDP, ZeRO 1/2/3, precision, sync
    sess.restore()                                     # the newest checkpoint of the run dir, if any
    for batch in sess.data(dataset):                   # this rank's micro-batches, up to train.steps
        loss = my_loss(model, batch)                   # any forward, any loss: the mean over the batch
        sess.backward(loss)
        sess.step()                                    # the update, at the end of each global batch
        sess.log(my_metric=...)
    sess.close()                                       # summary.json

It is a thin adapter over shoal's own Run (run.py), not a second copy: the layout is the Strategy's
parallelize(), a step begins as the Trainer begins one and ends in the Stepper's finish() (norm, clipping,
the non-finite policy, the update, the learning-rate schedule, the StepSync), the step's metrics, memory,
checkpoints and heartbeat go through the Trainer's after_step() and the Run's hooks, data through the
GlobalBatchSampler, and restore (checked against the config), checkpoints, the final weights and the summary
through the Run. What differs is only who runs the forward: the user's code, so the loss arrives
already computed, as the mean over one micro-batch; each backward is scaled by 1 / (micro-batches per
step) and the data-parallel wrapper averages over dp, which gives the global batch's mean loss when
micro-batches are the same size (the sampler makes them so).

The process group: joined as `shoal train`'s workers join it (under shoal run, torchrun or a
scheduler), or, when the script (Ray Train, Accelerate) already made one, that one is used.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from shoal import dist as shoal_dist
from shoal.checkpoint.resume import find_resume_point
from shoal.checkpoint.train_state import read_train_state
from shoal.comm.collectives import Comm
from shoal.comm.phase import Phase
from shoal.config import Config
from shoal.data.sampler import GlobalBatchSampler
from shoal.errors import UserError
from shoal.layout import choose_backend, choose_device, resolve_layout
from shoal.metrics.profile import FlopSource
from shoal.metrics.timers import StepTimer
from shoal.models.keras import KerasModule, check_layout, is_keras
from shoal.models.spec import ModelBundle, count_parameters
from shoal.parallel.data import set_grad_sync
from shoal.parallel.fit import check_model_fits
from shoal.rundir import RunDir, default_run_dir, write_json
from shoal.training.assemble import assemble, trainer
from shoal.training.build import freeze
from shoal.training.flags import host_tensor
from shoal.training.loop import Trainer, Watch, begin_step
from shoal.training.report import StepReport
from shoal.training.run import Run, Start
from shoal.training.session_config import refuse_conflicts, refuse_unhonoured, session_config
from shoal.training.session_data import Loader, UserData
from shoal.training.session_model import (
    autocast_forward,
    described,
    loss_in_your_loop,
    named_groups,
    rebuilt,
    tensor_parallel_of,
)
from shoal.training.step import Stepper
from shoal.training.strategy import Strategy


class Session:
    def __init__(self, config: str | Path | Config | None = None, *, overrides: dict | None = None,
                 run_dir: str | Path | None = None, **sections: dict):
        """`config`: a TOML file, a loaded Config, or None (the defaults); `overrides`: {"train.steps": 100,
        ...} as --set gives them; `sections`: whole sections as dicts, e.g. parallel={"zero": 3}."""
        cfg = self.cfg = session_config(config, overrides, sections)
        refuse_unhonoured(cfg)
        self.env, self.comm = join(cfg)
        self.layout = resolve_layout(cfg, self.env.world_size, cuda=torch.cuda.is_available())
        if self.layout.dims.pp > 1 or self.layout.servers or self.layout.cp > 1:
            raise UserError("parallel.pp > 1, parallel.cp > 1 and the parameter server run the loss inside shoal's "
                            "own loop; use `shoal train` for them, or parallel.pp = 1, parallel.cp = 1 and another "
                            "sync.mode in a Session")
        path = None if isinstance(config, Config) or config is None else str(config)
        where = Path(run_dir) if run_dir is not None else default_run_dir(path, cfg)
        run = RunDir(Path(self.comm.agree("run_dir", lambda: str(where))))
        strategy = Strategy(cfg, self.layout, self.env.device, self.env.rank, self.comm)
        self.start = Start(cfg=cfg, layout=self.layout, source=UserData(), dir=run, env=self.env, comm=self.comm,
                           phase=Phase(), strategy=strategy)
        # one per prepared model; the first one's loop, checkpoints and summary are the Session's
        self.runs: list[Run] = []
        self.sampler = GlobalBatchSampler(1, cfg.train.global_batch_size, cfg.train.seed)  # sess.data() sets it
        self.micro = 0  # micro-batches backward has seen in this step
        self.per_step = self.layout.grad_accum  # micro-batches per step (sess.data() may say otherwise)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.env.device)
        self.logged: dict = {}
        self.recovery: dict | None = None  # what restore() found, for the summary
        self.timer: StepTimer | None = None  # the step's, from its start
        self.sent = 0  # comm.sync_bytes when the step began
        self.has_data = False  # sess.data() was called: the sampler knows the data set
        self.restored_position: dict | None = None  # a restored data position waiting for sess.data()
        self.flops_per_sample: float | None = None
        self.described: list[dict] = []  # each prepared model's parameters, for `shoal plan --check`
        self.started = time.perf_counter()

    # --- the process group --------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def device(self) -> torch.device:
        return self.env.device

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    @property
    def run(self) -> RunDir:
        return self.start.dir

    @property
    def steps_done(self) -> int:
        return self.sampler.step

    @property
    def pairs(self) -> list[Stepper]:
        """Each prepared model's Stepper (its laid-out model, optimizer, schedule, number format)."""
        return [r.step for r in self.runs]

    @property
    def trainer(self) -> Trainer | None:
        """The loop's bookkeeping (metrics, hooks, the step read late): the first prepared model's Run's."""
        return self.runs[0].trainer if self.runs else None

    # --- the model ----------------------------------------------------------------------------------

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, blocks: tuple[type, ...] = (),
                tp_plan: Mapping[str, object] | None = None,
                flops_per_sample: float | None = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """`model` laid out as the config says and `optimizer` rebuilt over the laid-out parameters (same
        class, groups and hyperparameters); use what it returns. `blocks`: the module types that are units
        of ZeRO 2/3 sharding and activation checkpointing (e.g. your transformer block); `tp_plan`: for
        parallel.tp > 1, how the model's layers split ({"blocks.*.attn.q": "colwise", ...}, or DTensor
        ParallelStyles; models/tp_plan.py), else the plan a Hugging Face model declares;
        `flops_per_sample`: its training FLOPs per sample, for the step profile's MFU. Call it once per
        model; a step updates every prepared model."""
        model = self._accepted(model, optimizer)
        refuse_conflicts(self.cfg, optimizer)
        self.flops_per_sample = (self.flops_per_sample or 0) + flops_per_sample if flops_per_sample else None
        groups = named_groups(model, optimizer)
        self.described.append(described(model, tuple(blocks), optimizer))
        if self.world_size > 1:  # every rank starts from rank 0's weights, as DDP's constructor makes them
            self.comm.broadcast_module(model)
        freeze(model, self.cfg.train.freeze)
        bundle = self._bundle(model, tuple(blocks), tp_plan)
        run = assemble(self.start, bundle, lambda par: rebuilt(optimizer, groups, par),
                       n_params=count_parameters(model), num_train=1)
        par, precision = run.step.par, run.step.precision
        if precision.dtype != torch.float32:  # the forward the user calls runs under autocast, as shoal's
            par.module.forward = autocast_forward(par.module.forward, precision)
        self.runs.append(run)
        if len(self.runs) == 1:
            run.started = self.started
            run.sampler = run.state.parts["sampler"] = self.sampler
            flops = FlopSource(self.flops_per_sample, build=None, batch=None) if self.flops_per_sample else None
            trainer(run, items_name="samples", profiler=lambda: run.profiler(flops), validates=False)
            run.trainer.hooks.step_metrics = lambda: {**self.start.strategy.step_metrics(), **self.logged}
        if self.is_main:
            write_json(self.run.session_models, self.described)
        self._grad_sync()
        return par.module, run.step.optimizer

    def _accepted(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        """`model` as shoal trains it (a Keras model wrapped), after refusing what a Session cannot prepare."""
        cfg = self.cfg
        if self.runs and cfg.checkpoint.enabled:
            raise UserError("a Session's checkpoints hold one prepared model and its optimizer; for a second one, "
                            "set checkpoint.enabled = false and save them yourself (torch.distributed.checkpoint)")
        if optimizer.state:
            raise UserError("sess.prepare(model, optimizer): the optimizer has already stepped; prepare it before "
                            "its first step (its state would not follow the laid-out parameters)")
        if is_keras(model):  # a Keras 3 model (torch backend): trained as shoal train trains one (models/keras.py)
            model = KerasModule(model)
            check_layout(model, tp=cfg.parallel.tp, pp=cfg.parallel.pp, compile=cfg.train.compile,
                         activation_checkpointing=cfg.precision.activation_checkpointing)
        return model

    def _bundle(self, model: torch.nn.Module, blocks: tuple[type, ...], tp_plan: Mapping[str, object] | None):
        """The ModelBundle the Strategy lays out, checked against the config's layout."""
        bundle = ModelBundle(model=model, loss_fn=loss_in_your_loop, block_types=blocks,
                             tensor_parallel=tensor_parallel_of(model, tp_plan))
        if self.layout.dims.tp > 1 and bundle.tensor_parallel is None:
            raise UserError(f"parallel.tp = {self.layout.dims.tp}: model {type(model).__name__} declares no tensor-"
                            f"parallel plan; give one, sess.prepare(model, optimizer, tp_plan={{'layers.*.up': "
                            f"'colwise', 'layers.*.down': 'rowwise'}}), or set parallel.tp = 1")
        check_model_fits(bundle, type(model).__name__, self.cfg.parallel, self.cfg.precision)
        return bundle

    # --- the data -----------------------------------------------------------------------------------

    def data(self, dataset, batch_size: int | None = None, collate: Callable | None = None) -> Loader:
        """This rank's micro-batches of `dataset` (len() and [i]), `batch_size` samples each (default
        train.micro_batch_size, at most this rank's share), their tensors on `sess.device`, drawn by shoal's
        sampler: every global batch of train.global_batch_size samples is a pure function of (train.seed, step),
        so a restored run goes on with the very samples the uninterrupted one would have seen. Iterating ends
        after train.steps steps."""
        micro = batch_size or self.layout.micro_batch
        dp, batch = self.layout.dims.dp, self.cfg.train.global_batch_size
        if batch % (micro * dp):
            raise UserError(f"sess.data(batch_size={micro}): train.global_batch_size ({batch}) must be a multiple "
                            f"of batch_size x dp ({micro} x {dp}); change either")
        position = self.sampler.step
        self.sampler = GlobalBatchSampler(len(dataset), batch, self.cfg.train.seed)
        self.sampler.step = position
        if self.restored_position is not None:  # restore() came first: the data position it read
            try:
                self.sampler.load_state_dict(self.restored_position)
            except ValueError as e:
                raise UserError(f"sess.data(): cannot go on from the restored checkpoint: {e}") from None
            self.restored_position = None
        if self.runs:  # the loop's and the checkpoints' sampler from now on
            first = self.runs[0]
            first.sampler = self.trainer.sampler = first.state.parts["sampler"] = self.sampler
        self.has_data = True
        self.per_step = batch // (micro * dp)
        return Loader(self, dataset, micro, collate or torch.utils.data.default_collate)

    # --- a step -------------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's mean loss, scaled for accumulation; gradients are averaged over
        dp in the last micro-batch's backward (or as the config's sync mode says)."""
        self._need_prepare("backward")
        if self.timer is None:
            self._begin_step()
        if not self.timer.marked("data_wait_s"):
            self.timer.mark("data_wait_s")  # no sess.data(): the data is the user's, inside its forward
        self.loss_sum += loss.detach().double()  # on the device: nothing waits for it
        for stepper in self.pairs[:1]:  # one backward covers every model the loss came from
            stepper.precision.backward(loss / self.per_step)
        self.micro += 1
        self._grad_sync()

    def step(self) -> StepReport | None:
        """After each micro-batch's backward: at the last micro-batch of a step, the update (clipping, the
        non-finite policy, the schedule), the step's metrics and a checkpoint when one is due; returns the
        step's report then, None before. Its values (loss, grad_norm, bad, ...) are read from the device
        when first asked for: a loop that never reads them never waits for the device, and shoal reads
        them itself a step later (at once where the step validates, saves or is the last)."""
        self._need_prepare("step")
        if self.micro < self.per_step:
            return None
        step, timer, trainer = self.sampler.step, self.timer, self.trainer
        if self.logged:  # the step before, if still unread, is recorded without the values logged for this one
            mine, self.logged = self.logged, {}
            trainer.flush(None)
            self.logged = mine
        for stepper in self.pairs:
            stepper.par.after_backward()
        timer.mark("forward_backward_s")
        samples = host_tensor([float(self.per_step * self.layout.dims.dp)], self.device).to(self.device,
                                                                                           non_blocking=True)
        memory = trainer.memory_figures(step)
        lr = self.pairs[0].optimizer.param_groups[0]["lr"]  # the step's rate, before the schedule moves on
        reports = [s.finish(self.loss_sum, lambda: samples.reshape(()), step, timer, memory, self.sent, lr)
                   for s in self.pairs]
        self.micro = 0
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.sampler.step = step + 1
        trainer.advance(reports[0], None, now=bool(self.logged))  # values logged by hand: read now
        self.logged = {}
        self._grad_sync()
        self._begin_step()
        return reports[0]

    def log(self, **metrics: float) -> None:
        """Your own numbers, in metrics.jsonl and TensorBoard (rank 0's): during a step (before the step()
        that ends it), in that step's line; between steps, in a line of their own for the step just done."""
        values = {k: float(v) for k, v in metrics.items()}
        if self.micro == 0 and self.trainer is not None and self.trainer.record.history:
            for sink in self.trainer.sinks.files:
                sink.log({"step": self.sampler.step, **values})
        else:
            self.logged.update(values)

    # --- checkpoints --------------------------------------------------------------------------------

    def save(self) -> Path | None:
        """Collective: a checkpoint of the step reached (also taken every checkpoint.interval steps and at
        train.steps by step()); returns its folder (None when checkpoint.enabled is false)."""
        self._need_prepare("save")
        if not self.cfg.checkpoint.enabled:
            return None
        self.trainer.flush(None)
        saved = self.runs[0].save()
        self.runs[0].checkpoints.wait()
        return saved

    def restore(self) -> int:
        """Collective: the newest valid checkpoint of the run dir, if any (model, optimizer, schedule, data
        position, RNG streams: the run goes on exactly as it would have); returns the steps it holds (0:
        none, a fresh start)."""
        self._need_prepare("restore")
        found = self.comm.agree("resume_from", lambda: str(find_resume_point(self.run.checkpoints, "auto") or ""))
        if not found:
            return 0
        saved = read_train_state(Path(found))
        # before sess.data() the data set is not known: its position waits for it. What describes the run here
        # is the seed its sampler draws by (the model and the data are the user's code)
        self.recovery = self.runs[0].restore(Path(found), keep=() if self.has_data else ("sampler",),
                                             describes=("train.seed",), fresh="another run_dir")
        if not self.has_data:
            self.restored_position = saved["parts"]["sampler"]
            self.sampler.step = saved["step"]
        self._grad_sync()
        return self.sampler.step

    def close(self) -> dict:
        """Collective. Finish: the last step's metrics, a pending checkpoint written, the final weights
        (model.safetensors, as shoal train writes them, when checkpoint.final_weights and one model is
        prepared), summary.json (rank 0); returns the summary."""
        if not self.runs:
            self.start.strategy.finish()
            return {}
        run = self.runs[0]
        run.close()
        params = sum(p.numel() for s in self.pairs for p in s.par.model.parameters())
        summary = run.summary(recovery=self.recovery, model_name=type(self.pairs[0].par.model).__name__,
                              n_params=params)
        run.finish(summary, weights=len(self.runs) == 1)  # the final weights of the one model prepared
        return summary

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        elif self.runs:  # failing: no summary, but a save in flight is finished
            self.runs[0].checkpoints.close()

    # --- what a step needs around it ------------------------------------------------------------------

    def _begin_step(self) -> None:
        """A step's clock starts when the one before it ended (or at its first backward), as shoal train's loop
        starts its steps (before sess.prepare(), with no step profile or trace to tell)."""
        self.timer = (self.trainer.begin_step() if self.trainer is not None
                      else begin_step(Watch(phase=self.start.phase), self.device, None, self.sampler.step))
        self.sent = self.comm.sync_bytes

    def _grad_sync(self) -> None:
        """Whether the coming micro-batch's backward averages over dp: set before its forward, which is
        where DDP reads it."""
        for stepper in self.pairs:
            set_grad_sync(stepper.par.module, stepper.par.sync.reduces(self.micro, self.per_step))

    def _need_prepare(self, call: str) -> None:
        if not self.runs:
            raise UserError(f"sess.{call}() before sess.prepare(model, optimizer): prepare the model first")


def join(cfg: Config):
    """This process's DistEnv and Comm: the process group someone made already, or one joined as shoal
    train's workers join theirs."""
    if dist.is_initialized():
        env = existing_group()
    else:
        device = choose_device(cfg.parallel.device, torch.cuda.is_available())
        env = shoal_dist.init(choose_backend(cfg.parallel.backend, device), cfg.parallel.timeout_s, device=device)
    return env, Comm(env.store, env.rank, env.world_size)


def existing_group() -> shoal_dist.DistEnv:
    import os

    backend = dist.get_backend()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    store = dist.distributed_c10d._get_default_store()
    return shoal_dist.DistEnv(dist.get_rank(), dist.get_world_size(), local_rank,
                              int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                              int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), device, store, store)
