"""Model constructors as their authors write them, for holding shoal's sharded start (models/deferred.py: the
build recorded on the meta device, then replayed for each rank's share) against the eager build of the
same class after the same seed: tests/unit/test_corpus_one_process.py at one process,
tests/dist/test_corpus_layouts.py under ZeRO 3, tp 2 and pp 2.

Each entry is a `model.name` a run can give ("model_corpus:build" with `entry = NAME`, or a Hugging Face
class through shoal's own "hf" builder), so that the start under test is the one `shoal train` makes,
build_deferred's fallback to a whole build included. Third-party code runs unchanged: torchtitan's Llama
(tests/fixtures/torchtitan, its README says which commit), timm's VisionTransformer and torchvision's
ResNet (the installed packages, the test extra's).
"""

from __future__ import annotations

import importlib.util
import math
import sys
import types
from pathlib import Path

import numpy as np
import torch
from torch import nn

from shoal.models.gpt import GPTConfig
from shoal.models.hf import HFConfig
from shoal.models.registry import UserModelConfig
from shoal.models.spec import DataSpec, ModelBundle

TOKENS = DataSpec("tokens", vocab_size=256)


def _loss(model, batch):  # the corpus is about starts: no entry trains
    raise NotImplementedError


# --- every torch.nn.init function, each on a layer of its own -------------------------------------------

def _initialised(fn, *args, shape=(6, 4), **kwargs) -> nn.Module:
    layer = nn.Linear(shape[1], shape[0]) if len(shape) == 2 else nn.Conv2d(shape[1], shape[0], shape[2])
    fn(layer.weight, *args, **kwargs)
    return nn.Sequential(nn.Linear(shape[1], shape[1]), layer) if len(shape) == 2 else nn.Sequential(layer)


INIT = {
    "uniform_": lambda: _initialised(nn.init.uniform_, -0.3, 0.3),
    "normal_": lambda: _initialised(nn.init.normal_, 0.0, 0.02),
    # torch 2.13 samples by rejection, drawing until every value is inside [a, b]: how many draws depends on
    # the values (a wide interval; a narrow one takes the other branch)
    "trunc_normal_": lambda: _initialised(nn.init.trunc_normal_, std=0.02),
    "trunc_normal_narrow": lambda: _initialised(nn.init.trunc_normal_, mean=0.0, std=1.0, a=0.5, b=0.7),
    "constant_": lambda: _initialised(nn.init.constant_, 0.25),
    "ones_": lambda: _initialised(nn.init.ones_),
    "zeros_": lambda: _initialised(nn.init.zeros_),
    "eye_": lambda: _initialised(nn.init.eye_),
    "dirac_": lambda: _initialised(nn.init.dirac_, 2, shape=(4, 4, 3)),
    "xavier_uniform_": lambda: _initialised(nn.init.xavier_uniform_, gain=nn.init.calculate_gain("relu")),
    "xavier_normal_": lambda: _initialised(nn.init.xavier_normal_),
    "kaiming_uniform_": lambda: _initialised(nn.init.kaiming_uniform_, a=math.sqrt(5)),
    "kaiming_normal_": lambda: _initialised(nn.init.kaiming_normal_, mode="fan_out", nonlinearity="relu"),
    "orthogonal_": lambda: _initialised(nn.init.orthogonal_, gain=0.5),
    "orthogonal_wide": lambda: _initialised(nn.init.orthogonal_, shape=(4, 6)),
    "sparse_": lambda: _initialised(nn.init.sparse_, 0.3, std=0.05),
}


# --- the constructs of user models --------------------------------------------------------------------

class SeedsItself(nn.Module):
    """A constructor that seeds the generator (twice), as research code often does."""

    def __init__(self):
        super().__init__()
        self.before = nn.Linear(4, 4)
        torch.manual_seed(1234)
        self.a = nn.Linear(4, 8)
        nn.init.trunc_normal_(self.a.weight, std=0.1)
        torch.manual_seed(99)
        self.b = nn.Linear(8, 4)


class PrivateGenerator(nn.Module):
    """Its own seeded torch.Generator, for every init (the default generator is not touched)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 8)
        nn.init.normal_(self.a.weight, std=0.1, generator=g)
        nn.init.trunc_normal_(self.b.weight, std=0.1, generator=g)
        nn.init.orthogonal_(self.b.weight, generator=g)
        self.noise = nn.Parameter(torch.randn(3, generator=g))


class PythonData(nn.Module):
    """Parameters and buffers made from Python data: ReZero's gate, LayerScale, CLIP's logit scale, a fixed
    mask, a temperature from a tensor scalar."""

    def __init__(self, dim=8):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.gain = nn.Parameter(torch.tensor([1.0, 0.5]))
        self.rezero = nn.Parameter(torch.tensor(0.0))
        self.layer_scale = nn.Parameter(1e-5 * torch.ones(dim))
        self.logit_scale = nn.Parameter(torch.ones([]) * np.log(1 / 0.07))
        self.temperature = nn.Parameter(torch.tensor(0.07).log())
        self.register_buffer("mask", torch.tensor([[1, 0], [1, 1]], dtype=torch.bool))
        self.register_buffer("offsets", torch.tensor(3) * torch.arange(4))


class NumpyData(nn.Module):
    """Tensors from numpy arrays: a shared table, a fixed projection, a buffer."""

    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(3)
        self.fixed = nn.Parameter(torch.from_numpy(rng.standard_normal((4, 3)).astype(np.float32)))
        self.table = nn.Parameter(torch.as_tensor(np.linspace(0.0, 1.0, 5), dtype=torch.float32))
        self.register_buffer("bins", torch.tensor(np.arange(6) * 0.5))
        self.proj = nn.Linear(3, 4)


class Tied(nn.Module):
    """An embedding and an output head tied by assignment; the head's own init drew before it was tied."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight


class Views(nn.Module):
    """In-place edits through views: a padding row zeroed, a column block scaled, a transposed row filled,
    slices assigned through .data."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6, padding_idx=0)
        self.proj = nn.Linear(6, 6)
        with torch.no_grad():
            self.emb.weight[3].zero_()
            self.proj.weight[:, :2].mul_(0.1)
            self.proj.weight.t()[1].fill_(0.5)
            self.proj.bias.data[1:3] = 2.0
            self.proj.weight.unsqueeze_(0).squeeze_(0)


class ForksTheGenerator(nn.Module):
    """Draws, then inits one layer under torch.random.fork_rng: in one process the state put back is the one
    after the first draws, which a record on the meta device cannot know. Built whole instead."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)


class ReadsAValue(nn.Module):
    """Reads a value back from a tensor while building (a schedule from a drawn number). Built whole."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        width = 4 + int(torch.randint(1, 4, ()).item())
        self.b = nn.Linear(4, width)


class ReadsAComputedValue(nn.Module):
    """Reads back values computed from Python data alone (a width from an edited constant, a schedule from
    torch.linspace): computed from the record, so the build still records."""

    def __init__(self):
        super().__init__()
        sizes = torch.tensor([2.0, 3.0])
        sizes.mul_(2)
        self.a = nn.Linear(4, int(sizes[1].item()))
        self.rates = [x.item() for x in torch.linspace(0, 0.2, 3)]
        self.b = nn.Linear(int(sizes[1].item()), 4)


class SkipsOnMeta(nn.Module):
    """A library's init that skips its work on the meta device (as peft's SVD-based adapter inits do)."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(6, 6)
        self.adapter = nn.Linear(6, 2, bias=False)
        if self.adapter.weight.device.type != "meta":
            with torch.no_grad():
                u, _, _ = torch.linalg.svd(self.base.weight)
                self.adapter.weight.copy_(u[:2])


USER = {"seeds_itself": SeedsItself, "private_generator": PrivateGenerator, "python_data": PythonData,
        "numpy_data": NumpyData, "tied": Tied, "views": Views, "forks_the_generator": ForksTheGenerator,
        "reads_a_value": ReadsAValue, "reads_a_computed_value": ReadsAComputedValue, "skips_on_meta": SkipsOnMeta}
# the entries whose build a record cannot follow: each is built whole (training/build.py), with this reason
BUILT_WHOLE = {"forks_the_generator": "sets a random generator back", "reads_a_value": "depends on a random draw"}


# --- other people's models, unchanged (tests/fixtures/model_code: each folder's README says from where) --------

CODE = Path(__file__).parent / "fixtures" / "model_code"


def torchtitan_llama() -> nn.Module:
    """torchtitan's Llama 3: trunc_normal_ inits, a complex rotary buffer computed in init_weights."""
    if str(CODE / "torchtitan") not in sys.path:
        sys.path.insert(0, str(CODE / "torchtitan"))
    from torchtitan.models.llama.model import ModelArgs, Transformer

    return Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=32,
                                 multiple_of=32))


def _package(name: str, folder: Path) -> types.ModuleType:
    """A package named `name` over the files in `folder`, without an __init__ of its own."""
    if name not in sys.modules:
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]
        sys.modules[name] = package
    return sys.modules[name]


def torchvision_resnet() -> nn.Module:
    """torchvision's ResNet: kaiming_normal_ convolutions, batch norms with their running statistics, the
    last norm of each residual block zeroed (zero_init_residual)."""
    _package("corpus_torchvision", CODE / "torchvision")
    resnet = importlib.import_module("corpus_torchvision.models.resnet")
    return resnet.ResNet(resnet.BasicBlock, [1, 1, 1, 1], num_classes=10, zero_init_residual=True)


def _timm_init():
    spec = importlib.util.spec_from_file_location("corpus_timm_weight_init", CODE / "timm" / "weight_init.py")
    if spec.name not in sys.modules:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[spec.name] = module
    return sys.modules[spec.name]


class ViT(nn.Module):
    """A ViT initialised as timm's VisionTransformer.init_weights does it, with timm's own initialisers
    (tests/fixtures/model_code/timm): mode "" (init_weights_vit_timm) or "jax" (init_weights_vit_jax)."""

    def __init__(self, mode: str = "", dim: int = 32, depth: int = 2, patches: int = 16, classes: int = 10):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, 8, stride=8)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, patches + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[nn.ModuleDict({
            "norm1": nn.LayerNorm(dim), "qkv": nn.Linear(dim, 3 * dim), "proj": nn.Linear(dim, dim),
            "norm2": nn.LayerNorm(dim),
            "mlp": nn.ModuleDict({"fc1": nn.Linear(dim, 4 * dim), "fc2": nn.Linear(4 * dim, dim)})})
            for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)
        # timm's calculate_drop_path_rates: a schedule read back from a tensor, computed from the record
        self.drop_path_rates = [x.item() for x in torch.linspace(0, 0.1, depth)]
        self.init_weights(mode)

    def init_weights(self, mode: str) -> None:  # timm's VisionTransformer.init_weights, for these modes
        init = _timm_init()
        init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        for name, module in self.named_modules():
            if mode == "jax":
                self._jax(name, module, init)
            elif isinstance(module, nn.Linear):
                init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)

    @staticmethod
    def _jax(name: str, module: nn.Module, init) -> None:  # timm's init_weights_vit_jax
        if isinstance(module, nn.Linear):
            if name.startswith("head"):
                nn.init.zeros_(module.weight)
                nn.init.constant_(module.bias, 0.0)
            else:
                nn.init.xavier_uniform_(module.weight)
                nn.init.normal_(module.bias, std=1e-6) if "mlp" in name else nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Conv2d):
            init.lecun_normal_(module.weight)
            nn.init.zeros_(module.bias)


THIRD_PARTY = {"torchtitan_llama": torchtitan_llama, "torchvision_resnet": torchvision_resnet,
               "timm_vit": ViT, "timm_vit_jax": lambda: ViT("jax")}

BUILDERS = {**INIT, **USER, **THIRD_PARTY}


def build(cfg, spec) -> ModelBundle:
    """`model.name = "model_corpus:build"`, `model.entry = NAME`: the corpus's entry NAME."""
    return ModelBundle(BUILDERS[cfg.entry](), _loss)


class ForkedLM(nn.Module):
    """A token model that trains, whose build a record cannot follow (its head is initialised under
    torch.random.fork_rng after the embedding drew): `model.name = "model_corpus:forked_lm"`."""

    def __init__(self, vocab: int, dim: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.emb(tokens))))


def _lm_loss(model, batch):
    logits = model(batch["input"])
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch["target"].flatten(), ignore_index=-1,
                                       reduction="sum")


def forked_lm(cfg, spec) -> ModelBundle:
    return ModelBundle(ForkedLM(spec.vocab_size), _lm_loss, lambda batch: (batch["target"] != -1).sum(),
                       items_name="tokens")


# --- Hugging Face classes through shoal's own builder: their _init_weights --------------------------------

_SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
HF = {
    "hf_llama": {"model_type": "llama", **_SMALL, "num_key_value_heads": 2, "pad_token_id": 0},
    "hf_gpt2": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4},
    "hf_qwen2": {"model_type": "qwen2", **_SMALL, "num_key_value_heads": 2},
    "hf_mistral": {"model_type": "mistral", **_SMALL, "num_key_value_heads": 2},
    "hf_gemma": {"model_type": "gemma", **_SMALL, "num_key_value_heads": 2, "head_dim": 8},
    "hf_phi3": {"model_type": "phi3", **_SMALL, "num_key_value_heads": 2, "pad_token_id": 0},
    "hf_gpt_neox": {"model_type": "gpt_neox", **_SMALL},
    "hf_opt": {"model_type": "opt", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
               "ffn_dim": 64, "word_embed_proj_dim": 32, "max_position_embeddings": 64},
    "hf_bloom": {"model_type": "bloom", "hidden_size": 32, "n_layer": 2, "n_head": 4},
    "hf_qwen3_moe": {"model_type": "qwen3_moe", **_SMALL, "num_key_value_heads": 2, "num_experts": 4,
                     "num_experts_per_tok": 2, "moe_intermediate_size": 16, "head_dim": 8},
    "hf_mixtral": {"model_type": "mixtral", **_SMALL, "num_key_value_heads": 2, "num_local_experts": 4},
    # an encoder, as a sequence classifier: its padding row zeroed, the classifier's own init
    "hf_bert": {"model_type": "bert", **_SMALL, "num_labels": 3, "pad_token_id": 0},
}


def config(name: str):
    """The model config section and data spec of entry `name`."""
    if name == "gpt":  # shoal's own, for its real pipeline split under pp 2
        return GPTConfig(n_layer=2, d_model=32, n_head=4, seq_len=16), TOKENS
    if name in HF:
        task = "sequence-classification" if "num_labels" in HF[name] else "causal-lm"
        return HFConfig(config=HF[name], seq_len=16, task=task), TOKENS
    return UserModelConfig(name="model_corpus:build", entry=name), TOKENS


ALL = [*BUILDERS, *HF, "gpt"]
