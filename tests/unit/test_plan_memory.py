"""The planner's memory model against the published analysis: activations per layer as Korthikanti et al.
2022 (Reducing Activation Recomputation in Large Transformer Models, section 4) count them, with tensor
and sequence parallelism, the pipeline's micro-batches in flight on its first stage, and mixed precision's
16-bit copies (autocast's weights, ZeRO 2/3's gathers). Pure Python on the meta device."""

import pytest

from shoal.config import load_config
from shoal.layout import resolve_layout
from shoal.plan.cost import GATHERED
from shoal.plan.planner import Model, predict
from shoal.plan.predict import in_flight

# a GPT whose attention weighs in a layer as a large one's does: a s / h = 8 (GPT-3 175B: 16)
H, A, S, B, L = 256, 8, 256, 2, 4
SHAPE = [f"model.n_layer={L}", f"model.d_model={H}", f"model.n_head={A}", f"model.seq_len={S}",
         "model.vocab_size=512", "data.max_bytes=200000", "train.global_batch_size=8", f"train.micro_batch_size={B}"]


@pytest.fixture(scope="module")
def stack():
    """Traced as Megatron-LM ran it on a GPU in 2021-2022: attention materialised with dropout 0.1, hidden
    dropout 0.1, dropout's 1-byte mask."""
    cfg = load_config(None, SHAPE)
    return Model.build(cfg, False, 0.1, 0.1, cuda=True).cost(B)


def test_a_layer_s_activations_are_korthikanti_s(stack):
    """Bytes a layer saves in 16 bits, s b h (34 + 5 a s / h) without parallelism, s b h (10 + 24 / t +
    5 a s / (h t)) with tensor parallelism t (section 4.2.1). Within 1%: the norms' fp32 statistics (8 s b
    bytes a layer) are not in the paper's count. With sequence parallelism the paper's 34 / t holds but for
    the two column-parallel layers' inputs: torch's sequence parallelism (DTensor) gathers the sequence
    before them and they keep the gathered input, 2 s b h each, whole on every rank."""
    sbh = S * B * H
    for tp, sequence_parallel, want in ((1, False, 34 + 5 * A * S / H), (4, False, 10 + 24 / 4 + 5 * A * S / (H * 4)),
                                        (4, True, 30 / 4 + 4 + 5 * A * S / (H * 4))):
        _, per_block, _ = stack.on_rank(0.5, tp, sequence_parallel)
        assert per_block == [pytest.approx(want * sbh, rel=0.01)] * L, (tp, sequence_parallel)


def test_memory_saved_twice_counts_once_and_the_column_parallel_inputs_are_whole(stack):
    """q, k and v's layers each save their input, one tensor: counted once. A block's whole inputs of split
    layers are the first norm's output (for q, k, v) and the second's (for the MLP): 2 s b h in fp32."""
    for block in range(L):
        gathered = sum(n for (b, where, _), n in zip(stack.saved_kinds, stack.saved, strict=True)
                       if b == block and where == GATHERED)
        assert gathered == 2 * S * B * H * 4


def test_the_first_pipeline_stage_holds_the_layers_korthikanti_counts():
    """1F1B's first stage holds pp micro-batches of its L / pp layers, L layers' worth (section 4.2.3);
    interleaved 1F1B with v stages a rank L (1 + (p - 1) / (p v)); GPipe every micro-batch."""
    cfg = load_config(None, [*SHAPE, "parallel.pp=4", "train.micro_batch_size=1", "parallel.pp_microbatches=8"])
    layout = resolve_layout(cfg, 4, False)
    assert layout.pp_microbatches == 8
    assert in_flight(layout, "1f1b") == 4 and in_flight(layout, "gpipe") == 8
    p, v = 4, 2
    assert in_flight(layout, "interleaved-1f1b", v) / p == pytest.approx(1 + (p - 1) / (p * v))


def _memory(keys, world=2):
    cfg = load_config(None, [*SHAPE, "train.global_batch_size=8", *keys])
    model = Model.build(cfg)
    return model, predict(model, cfg, resolve_layout(cfg, world, False), None)


def test_autocast_s_weight_copies_and_bf16_gathers_are_16_bit():
    """In 16 bits autocast keeps a 16-bit copy of each weight matrix for backward (ZeRO 0/1), while ZeRO 2/3
    gather 16-bit parameters (FSDP2's mixed precision), not fp32 ones (on CPU the activations' bytes are
    the trace's in both: only the copies differ)."""
    model, fp32 = _memory(["parallel.dp=2"])
    _, bf16 = _memory(["parallel.dp=2", 'precision.dtype="bf16"'])
    matrices = sum(n for n, _, ndim, *_ in model.shape.params if ndim >= 2)
    assert bf16.memory["buffers"] - fp32.memory["buffers"] == 2 * matrices
    assert {k: bf16.memory[k] for k in ("params", "grads", "optimizer")} == \
        {k: fp32.memory[k] for k in ("params", "grads", "optimizer")}
    _, z3 = _memory(["parallel.dp=2", "parallel.zero=3"])
    _, z3_bf16 = _memory(["parallel.dp=2", "parallel.zero=3", 'precision.dtype="bf16"'])
    largest = model.cost(B).largest
    block = max(sum(n for n, *_ in b) for b in model.shape.block_params)
    assert z3.memory["buffers"] == 2 * 4 * block  # two blocks gathered (one prefetched)
    assert z3_bf16.memory["buffers"] == 2 * 2 * block
    assert z3.memory["working"] == largest  # on CPU the largest tensor's gradient


def test_bf16_zero_3_moves_16_bit_parameters_and_gradients_in_the_reduce_dtype():
    """Priced at a measured cost per byte FSDP2 moves: gathers and reduce-scatters in bf16 move half the
    fp32 bytes; with reduce-scatters in fp32 (precision.reduce_dtype) in between."""
    from shoal.hardware import HardwareProfile

    curves = {op: [(4096.0, 1e-4), (2 ** 26, 1e-4 + 2 ** 26 * 1e-9)] for op in ("all_gather", "reduce_scatter")}
    profile = HardwareProfile(matmul_flops={"fp32": 1e10, "bf16": 1e10}, memory_bandwidth=1e10, collectives=curves,
                              parallel_overheads={"fsdp_call_s": 0.0, "fsdp_byte_s": 1e-9})

    def comm(*keys):
        cfg = load_config(None, [*SHAPE, "parallel.dp=2", "parallel.zero=3", *keys])
        return predict(Model.build(cfg), cfg, resolve_layout(cfg, 2, False), profile).time["comm"]

    fp32, bf16 = comm(), comm('precision.dtype="bf16"', 'precision.reduce_dtype="bf16"')
    assert bf16 == pytest.approx(fp32 / 2, rel=1e-9)
    assert bf16 < comm('precision.dtype="bf16"') < fp32


def test_recomputation_all_reduces_the_row_parallel_outputs_again():
    """Under tp each block's forward all-reduces its row-parallel layers' outputs (attention's projection, the
    MLP's down): two a block, found by the trace. A recomputed forward runs them again (so does
    Megatron-LM's): checkpointing adds one activation-sized all-reduce each, per micro-batch."""
    from shoal.hardware import HardwareProfile

    curves = {op: [(4096.0, 1e-4), (2 ** 26, 1e-4 + 2 ** 26 * 1e-9)] for op in ("all_reduce", "send_recv")}
    profile = HardwareProfile(matmul_flops={"fp32": 1e10}, memory_bandwidth=1e10, collectives=curves)
    cfg = load_config(None, [*SHAPE, "parallel.tp=2"])
    model = Model.build(cfg)
    assert model.cost(B).row_parallel == 2 * L

    def comm(ckpt):
        c = load_config(None, [*SHAPE, "parallel.tp=2", f"precision.activation_checkpointing={ckpt}"])
        return predict(model, c, resolve_layout(c, 2, False), profile).time["comm"]

    n_micro = 8 // B  # the global batch on one dp rank
    residual = S * B * H * 4  # a block's input, fp32
    assert comm("true") - comm("false") == pytest.approx(
        n_micro * 2 * L * profile.collective_time("all_reduce", residual), rel=1e-9)


@pytest.mark.slow
def test_gpt3_175b_without_recomputation_does_not_fit_an_80_gib_gpu_at_t8_p8():
    """Korthikanti et al. 2022 (Fig. 1): GPT-3 175B at t 8, p 8 does not fit in 80 GB without recomputation,
    and does with it. Their count for the first stage of interleaved 1F1B (v = 3, micro-batch 1): L s b h
    (10 + 24 / t + 5 a s / (h t)) (1 + (p - 1) / (p v)) bytes, 66.8 GiB; within 2% (the embeddings' and
    the norms' statistics are not in it). Model state 16 bytes a parameter (fp32 weights, gradients and
    AdamW's moments) and autocast's 16-bit copy: about 18 / 64 of 175B, 49 GB; exactly, the first pp rank's
    share: the embeddings and 12 of the 96 blocks (its 3 stages of 24), what the GPT's tp plan splits
    (gpt_parallel.py) over 8, the rest whole on every tp rank."""
    s, h, a, layers, t, p, v = 2048, 12288, 96, 96, 8, 8, 3
    keys = [f"model.n_layer={layers}", f"model.d_model={h}", f"model.n_head={a}", f"model.seq_len={s}",
            "model.vocab_size=51200", "data.max_bytes=200000", "train.global_batch_size=64",
            "train.micro_batch_size=1", 'precision.dtype="fp16"', f"parallel.tp={t}", f"parallel.pp={p}",
            'parallel.pp_schedule="interleaved-1f1b"', f"parallel.pp_stages_per_rank={v}"]
    from shoal.hardware import preset

    profile = preset("a100").model_copy(update={"nproc": 8, "nnodes": 8})
    model = Model.build(load_config(None, keys), False, 0.1, 0.1, cuda=True)
    peak = {}
    for ckpt in ("true", "false"):
        cfg = load_config(None, [*keys, f"precision.activation_checkpointing={ckpt}"])
        peak[ckpt] = predict(model, cfg, resolve_layout(cfg, 64, True), profile).memory
    want = layers * s * h * (10 + 24 / t + 5 * a * s / (h * t)) * (1 + (p - 1) / (p * v))
    assert peak["false"]["activations"] == pytest.approx(want, rel=0.02)
    state = sum(peak["false"][k] for k in ("params", "grads", "optimizer"))
    # split: q, k, v, proj, up, down (12 h^2), the column-parallel layers' biases (q, k, v: 3h, up: 4h), the
    # token embedding (tied to the head); whole: proj's and down's biases and two LayerNorms (6h a block), and
    # the position table
    split, whole = 12 * (12 * h * h + 7 * h) + 51200 * h, 12 * 6 * h + s * h
    assert state == 16 * (split // t + whole) + 4 * (12 * 16 + 2)  # AdamW's step: 4 bytes a tensor
    assert peak["false"]["peak"] > 80 * 2 ** 30 > peak["true"]["peak"]
