"""What shoal takes from a Keras model's compile(): its loss (a Keras Loss whose reduction is the mean over the
batch, which the model's forward computes; models/keras.py) and its metrics that are a mean over samples, and
how a batch is split into the model's input and target. A compiled model's bundle is built in models/keras.py.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.errors import UserError, first_line
from shoal.models.spec import Batch

# what a batch's target is called by shoal's sources (images: label, tokens: target) and by convention (y)
TARGET_KEYS = ("label", "target", "y")
# Keras reductions that are a mean over the batch's elements: times the samples, a sum over samples
MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")


def as_float(out):
    """Outputs in fp32 for the loss and metrics (under bf16 autocast they come out in bf16)."""
    return out.float() if isinstance(out, torch.Tensor) and out.is_floating_point() else out


def compiled_loss(keras, model):
    """The compiled loss as a Keras Loss (None when the model was not compiled with one)."""
    loss = getattr(model, "loss", None)
    if loss is None:
        return None
    if isinstance(loss, (list, tuple, dict)) or len(getattr(model, "outputs", None) or [None]) > 1:
        raise UserError("the Keras model has several outputs or losses; shoal trains one output with one loss "
                        "(return (model, loss_fn) to combine them yourself)")
    try:
        loss = keras.losses.get(loss)
    except (ValueError, TypeError) as e:
        raise UserError(f"the Keras model's loss: {first_line(e)}") from None
    if not isinstance(loss, keras.losses.Loss):  # a name or a function: wrapped as compile() wraps it
        from keras.src.losses.losses import LossFunctionWrapper

        loss = LossFunctionWrapper(loss)
    if loss.reduction not in MEAN_REDUCTIONS:
        raise UserError(f"the Keras model's loss has reduction={loss.reduction!r}; shoal trains the mean over "
                        f"the global batch: compile with the default reduction (\"sum_over_batch_size\")")
    return loss


def split_batch(batch: Batch):
    """(x, y): the target is the key "label", "target" or "y"; x is the other key's tensor, or a dict of them
    (a model with several named inputs)."""
    target = next((k for k in TARGET_KEYS if k in batch), None)
    if target is None:
        raise UserError(f"a Keras model trains on batches with a target named {', '.join(TARGET_KEYS)}; this "
                        f"batch has {', '.join(batch)}: rename its target (data.source)")
    inputs = {k: v for k, v in batch.items() if k != target}
    x = next(iter(inputs.values())) if len(inputs) == 1 else inputs
    return x, batch[target]


def keras_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = split_batch(batch)
    return model(x, y)[1]


class KerasMetrics:
    """eval_fn: the loss and the compiled metrics, each a mean over samples (accuracy, mae, ...) that shoal
    adds up across batches and ranks as (sum, samples). "accuracy" is resolved on the first validation batch,
    from its shapes, as Keras's compile does."""

    def __init__(self, keras, model):
        self.identifiers = compiled_metrics(keras, model)
        self.metrics = None

    def __call__(self, module: nn.Module, batch: Batch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        from keras.src.trainers.compile_utils import get_metric  # compile's own resolution (MeanMetricWrappers)

        x, y = split_batch(batch)
        out, loss = module(x, y)
        n = torch.tensor(len(y))
        result = {"loss": (loss, n)}
        if self.metrics is None:
            self.metrics = [get_metric(m, y, out) for m in self.identifiers]
        for metric in self.metrics:  # a MeanMetricWrapper's per-sample function, unreduced
            values = metric._fn(y, as_float(out), **metric._fn_kwargs)
            result[metric.name] = (torch.as_tensor(values).float().mean() * len(y), n)
        return result


def compiled_metrics(keras, model) -> list:
    """The metrics compile() was given, each checked to be a mean over samples."""
    compiled = getattr(model, "_compile_config", None)  # (get_compile_config() serializes the optimizer too)
    config = getattr(compiled, "config", None) or {}
    metrics = config.get("metrics") or []
    if isinstance(metrics, dict) or config.get("weighted_metrics"):
        raise UserError("the Keras model's metrics are per output or weighted; compile it with a list of "
                        "metrics (or none)")
    metrics = list(metrics) if isinstance(metrics, (list, tuple)) else [metrics]
    for identifier in metrics:
        if str(identifier).lower() in ("accuracy", "acc"):
            continue
        metric = keras.metrics.get(identifier)
        if isinstance(metric, keras.metrics.Metric) and not isinstance(metric, keras.metrics.MeanMetricWrapper):
            raise UserError(f"the Keras model's metric {metric.name!r} is not a mean over samples, which shoal "
                            f"adds up across batches and ranks; compile without it")
    return metrics
