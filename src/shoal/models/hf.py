"""Hugging Face transformers models: model.name = "hf" (the `hf` extra).

The module shoal trains is the transformers model itself (LlamaForCausalLM, GPT2LMHeadModel, ...), so
its parameter names are the Hub's: a checkpoint exports to a directory that `from_pretrained` loads,
and a Hub directory's weights load into it by name. What the parallel layouts need is read from what
transformers declares on the model:

  ZeRO 2/3 units, activation checkpointing   the classes `_no_split_modules` names (the decoder layer)
  tensor parallelism                         the config's `base_model_tp_plan`: module pattern ->
                                             "colwise" / "rowwise", as DTensor's Colwise/RowwiseParallel

The loss is shoal's (summed cross-entropy and its item count, [Note: loss contract] in spec.py), not
the model's own mean, so accumulation and data parallelism give one big batch's gradient.
Batches: causal-lm takes the token sources' {"input", "target"}; sequence-classification takes
{"input": (B, T) int64, "label": (B,) int64} and an optional "attention_mask" (a user data source).
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from shoal.errors import UserError, first_line, require
from shoal.models.spec import Batch, DataSpec, ModelBundle, ModelSection
from shoal.models.tp_plan import parallelize, refuse_sequence_parallel, resolve, split_by

FEATURE = 'model.name = "hf"'
ROUTED_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # transformers configs' names


class LoraSection(BaseModel):
    """Low-rank adapters (Hu et al. 2021) through peft: the model's weights are frozen and each target
    linear layer learns W + (alpha / r) B A, with A (r x in) and B (out x r, zero at the start)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, use_attribute_docstrings=True)
    r: int = Field(8, ge=1)
    """Rank of the adapters."""
    alpha: float = Field(16.0, gt=0.0)
    """Scale numerator: the update is alpha / r x B A."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input."""
    target_modules: list[str] = []
    """Names (suffixes) of the linear layers that get adapters, e.g. ["q_proj", "v_proj"]; empty: peft's
    default for the model type."""


class HFConfig(ModelSection):
    """A Hugging Face transformers model, built from a local config (nothing is downloaded): a causal LM
    on a text or token source, or a sequence classifier on your data set. Needs `pip install -e '.[hf]'`."""

    data_kinds: ClassVar = None  # checked in build(): the task decides
    name: Literal["hf"] = "hf"
    path: str | None = None
    """A local directory with config.json, as save_pretrained writes it. If it also holds weights
    (model.safetensors or a sharded index), they are the initial weights of a fresh start, as with
    from_pretrained (model.init_from names others)."""
    config: dict[str, Any] = {}
    """The config inline: model_type and its sizes (e.g. {model_type = "llama", hidden_size = 256,
    num_hidden_layers = 4, ...}); with `path`, keys that override its config.json. vocab_size defaults to
    the data's vocabulary."""
    task: Literal["causal-lm", "sequence-classification"] = "causal-lm"
    """causal-lm: next-token prediction (AutoModelForCausalLM). sequence-classification: one label per
    sequence (AutoModelForSequenceClassification; the config's num_labels, default the data's classes)."""
    seq_len: int | None = Field(None, ge=2)
    """Context length: tokens per sample, for text and token sources."""
    lora: LoraSection | None = None
    """Train low-rank adapters instead of the weights (peft): [model.lora] r, alpha, dropout,
    target_modules. `shoal export --format hf` merges them into the weights."""

    def initial_weights(self) -> str | None:
        from shoal.models.pretrained import has_weights

        return self.init_from or (self.path if self.path and has_weights(self.path) else None)

    def routed_experts(self) -> tuple[int, str] | None:
        """The transformers config's routed experts (num_experts: Qwen-MoE; num_local_experts: Mixtral;
        n_routed_experts: DeepSeek), if any, named by the key model.config sets where it sets one (a config may
        answer to several: Mixtral's num_experts is its num_local_experts)."""
        config = hf_config(self)
        for key in sorted(ROUTED_EXPERTS_KEYS, key=lambda k: k not in self.config):
            n = getattr(config, key, None)
            if isinstance(n, int) and n > 0:
                return n, f"model.config.{key}"
        return None

    @property
    def peft_task(self) -> str:
        return {"causal-lm": "CAUSAL_LM", "sequence-classification": "SEQ_CLS"}[self.task]


def hf_config(cfg: HFConfig, spec: DataSpec | None = None):
    """The transformers config: config.json at model.path and/or the inline keys."""
    transformers = require("transformers", "hf", FEATURE)
    overrides = dict(cfg.config)
    if cfg.path is None:
        if "model_type" not in overrides:
            raise UserError('model.name = "hf" needs model.path (a directory with config.json) or model.config with '
                            'a model_type, e.g. model.config = {model_type = "llama", hidden_size = 256}')
        if spec is not None and spec.vocab_size and "vocab_size" not in overrides:
            overrides["vocab_size"] = spec.vocab_size
        try:
            return transformers.AutoConfig.for_model(**overrides)
        except (ValueError, TypeError) as e:
            raise UserError(f"model.config: {first_line(e)}") from None
    path = Path(cfg.path).expanduser()
    if not (path / "config.json").is_file():
        raise UserError(f"model.path = {cfg.path!r} has no config.json; point it at a directory written by "
                        f"save_pretrained (or a Hub snapshot)")
    try:
        return transformers.AutoConfig.from_pretrained(str(path), local_files_only=True, **overrides)
    except (OSError, ValueError, TypeError) as e:
        raise UserError(f"model.path = {cfg.path!r}: {first_line(e)}") from None


def build(cfg: HFConfig, spec: DataSpec) -> ModelBundle:
    transformers = require("transformers", "hf", FEATURE)
    config = hf_config(cfg, spec)
    if cfg.task == "causal-lm":
        if spec.kind not in ("tokens", "custom"):
            raise UserError(f'model.task = "causal-lm" trains on text or tokens, not on data of kind "{spec.kind}"; '
                            f'use a text source or model.task = "sequence-classification"')
        if spec.vocab_size and config.vocab_size < spec.vocab_size:
            raise UserError(f"the model's vocab_size ({config.vocab_size}) is smaller than the data's vocabulary "
                            f"({spec.vocab_size}); raise model.config.vocab_size or use the model's own tokenizer")
        positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if cfg.seq_len and positions and cfg.seq_len > positions:
            raise UserError(f"model.seq_len ({cfg.seq_len}) exceeds the model's {positions} positions; lower it")
        auto, loss_fn, eval_fn, items = transformers.AutoModelForCausalLM, causal_lm_loss, None, "tokens"
        count_fn = count_tokens
    else:
        if spec.num_classes and "num_labels" not in cfg.config:
            config.num_labels = spec.num_classes
        if config.pad_token_id is None:
            raise UserError("sequence classification reads the last token that is not padding: set "
                            "model.config.pad_token_id (your tokenizer's pad token id)")
        auto, loss_fn, eval_fn, items = (transformers.AutoModelForSequenceClassification, classification_loss,
                                         classification_eval, "samples")
        count_fn = count_labels
    try:
        model = auto.from_config(config, dtype=torch.float32)  # fp32 master weights, whatever the config says
    except ValueError as e:
        raise UserError(f"model.task = {cfg.task!r}: {first_line(e)}") from None
    model.config.use_cache = False  # training: no key/value cache
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = tuple({type(m) for m in model.modules() if type(m).__name__ in names})
    return ModelBundle(model, loss_fn, count_fn, eval_fn=eval_fn, block_types=blocks, items_name=items,
                       takes_positions=cfg.task == "causal-lm",
                       tensor_parallel=tensor_parallel if tp_plan(model) else None,
                       tp_split=tp_split_parameters if tp_plan(model) else None)


@contextlib.contextmanager
def unpacked_rows():
    """[Note: unpacked rows] Before a forward without an attention mask, transformers looks for several
    sequences packed into one row (position ids that start again: masking_utils.find_packed_sequence_indices)
    and branches on `(packed[:, -1] == 0).all()`, read on the host: on a GPU every micro-batch's forward
    waits there for the device, and on the meta device (`shoal plan` traces the model there) it cannot be
    read at all. Without position ids the model numbers every row 0..T-1 and the answer is always "nothing
    packed" (None); given here, the forward is the same (bitwise) and never reads the device. The position ids
    shoal does pass are parallel.cp's share of each row (whose jumps are not documents) or packed documents'
    (data.pack_documents), whose attention shoal keeps inside each document itself (models/documents.py),
    without a read. A transformers without the function is left as it is."""
    from transformers import masking_utils

    find = getattr(masking_utils, "find_packed_sequence_indices", None)
    if find is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = _nothing_packed
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = find


def _nothing_packed(position_ids: torch.Tensor) -> None:
    return None


def causal_lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The next-token loss summed over the counted tokens; in training, with a mixture of experts' router balance
    loss where its config asks transformers for it (output_router_logits: Mixtral, Qwen-MoE, ...), weighted by
    router_aux_loss_coef as transformers adds it to its own loss, and by the micro-batch's counted tokens: the
    loss contract's sum ([Note: loss contract] in spec.py), so that after the division by the global batch's
    tokens it is transformers' mean over the micro-batches (each the same set of sequences on any layout)."""
    # parallel.cp's share of each sequence, or packed documents' positions (their attention: models/documents.py)
    positions = batch.get("positions")
    with unpacked_rows():
        out = model(input_ids=batch["input"], use_cache=False, **({} if positions is None else {
            "position_ids": positions.expand(batch["input"].shape[0], -1)}))
    loss = F.cross_entropy(out.logits.flatten(0, 1).float(), batch["target"].flatten(), ignore_index=-1,
                           reduction="sum")
    aux = getattr(out, "aux_loss", None)
    if aux is not None and model.training:
        loss = loss + _config(model).router_aux_loss_coef * aux.float() * count_tokens(batch)
    return loss


def _config(model: nn.Module):
    """The transformers config of `model`, or of the model a wrapper holds (DDP's `module`)."""
    while not hasattr(model, "config"):
        model = model.module
    return model.config


def count_tokens(batch: Batch) -> torch.Tensor:
    return (batch["target"] != -1).sum()


def count_labels(batch: Batch) -> torch.Tensor:
    return torch.tensor(len(batch["label"]))


def _logits(model: nn.Module, batch: Batch) -> torch.Tensor:
    with unpacked_rows():  # without an attention mask, as in causal_lm_loss
        return model(input_ids=batch["input"], attention_mask=batch.get("attention_mask"), use_cache=False).logits


def classification_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return F.cross_entropy(_logits(model, batch).float(), batch["label"], reduction="sum")


def classification_eval(model: nn.Module, batch: Batch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    logits, n = _logits(model, batch).float(), count_labels(batch)
    return {"loss": (F.cross_entropy(logits, batch["label"], reduction="sum"), n),
            "accuracy": ((logits.argmax(-1) == batch["label"]).sum(), n)}


# --- tensor parallelism from the model's declared plan ---------------------------------------------

def tp_plan(model: nn.Module) -> dict[str, str]:
    """The base model's plan with the base model's prefix: {"model.layers.*.self_attn.q_proj": "colwise", ...}."""
    plan = getattr(model.config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    return {f"{prefix}.{k}" if prefix else k: v for k, v in plan.items()}


def tp_split_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters `tensor_parallel` splits (ModelBundle.tp_split): the weights of the layers the plan
    names and a column-wise layer's bias (tp_plan.split_by); the embeddings, norms, output head and a
    row-wise layer's bias are whole on every tp rank."""
    return split_by(model, resolve(model, tp_plan(model), 1, strict=False))


def tensor_parallel(model, tp: int, mesh=None, sequence_parallel: bool = False):
    """Split `model` by its `base_model_tp_plan` over the tp mesh (see the module docstring): attention by
    heads, MLPs by hidden units; embeddings, norms and the output head stay replicated."""
    config = model.config
    refuse_sequence_parallel(sequence_parallel)
    if any(type(m).__module__.startswith("peft") for m in model.modules()):
        raise UserError("model.lora with parallel.tp > 1 is not supported (the plan names the base layers that the "
                        "adapters wrap); set parallel.tp = 1 and shard with parallel.zero instead")
    sizes = {"num_attention_heads": getattr(config, "num_attention_heads", None),
             "num_key_value_heads": getattr(config, "num_key_value_heads", None),
             "intermediate_size": getattr(config, "intermediate_size", None)}
    for key, n in sizes.items():
        if n is not None and n % tp:
            raise UserError(f"parallel.tp ({tp}) must divide the model's {key} ({n}); choose a tp that divides it")
    for key in ("attention_dropout", "hidden_dropout", "resid_pdrop", "attn_pdrop"):
        if getattr(config, key, 0.0):
            raise UserError(f"the model's {key} > 0 with parallel.tp > 1 is not supported (dropout masks would "
                            f"differ between tensor-parallel ranks); set model.config.{key} = 0")
    styles = resolve(model, tp_plan(model), tp, strict=False)  # a style shoal does not translate: refused here
    if mesh is None:
        return None
    parallelize(model, mesh, styles)
    return None  # the output head is replicated: the loss needs no context


# --- adapters and export -----------------------------------------------------------------------------

def with_lora(bundle: ModelBundle, lora: LoraSection, task: str) -> ModelBundle:
    """The bundle's model with peft's LoRA adapters; only they (and a classifier's head) train."""
    peft = require("peft", "hf", "model.lora")
    config = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, task_type=task,
                             target_modules=list(lora.target_modules) or None)
    try:
        with warnings.catch_warnings():  # peft asks transformers a question deprecated in v5
            warnings.simplefilter("ignore", FutureWarning)
            bundle.model = peft.get_peft_model(bundle.model, config)
    except ValueError as e:
        raise UserError(f"model.lora: {first_line(e)}") from None
    return bundle


def save_pretrained(model: nn.Module, out: Path) -> nn.Module:
    """Write `model` as a Hugging Face directory (config.json + model.safetensors); adapters merged."""
    require("transformers", "hf", "--format hf").utils.logging.disable_progress_bar()  # one line of output
    with warnings.catch_warnings():  # as in with_lora
        warnings.simplefilter("ignore", FutureWarning)
        if hasattr(model, "merge_and_unload"):
            model = model.merge_and_unload()
        model.save_pretrained(str(out), safe_serialization=True)
    return model
