"""Config loading: TOML + --set overrides, one-line errors naming origin, key, value and fix."""

import pytest

from shoal.config import DataConfig, load_config, validate_config
from shoal.errors import UserError


def write(tmp_path, text):
    p = tmp_path / "cfg.toml"
    p.write_text(text)
    return p


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(UserError) as e:
        fn(*args, **kwargs)
    msg = str(e.value)
    assert "\n" not in msg, "user errors are one line"
    return msg


def test_defaults_and_overrides(tmp_path):
    cfg = load_config(write(tmp_path, "[train]\nsteps = 7\n"),
                      ["train.lr=3e-4", "model.n_layer=2", "parallel.dp=2", "metrics.tensorboard=false"])
    assert cfg.train.steps == 7 and cfg.train.lr == 3e-4
    assert cfg.model.name == "gpt" and cfg.model.n_layer == 2
    assert cfg.parallel.dp == 2 and cfg.metrics.tensorboard is False
    assert cfg.data.source == "stdlib-text"  # default kept


def test_bare_word_override_is_a_string(tmp_path):
    cfg = load_config(None, ["model.name=resnet", "data.source=synthetic-images"])
    assert cfg.model.name == "resnet"


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["model.name=ncf", "data.source=interactions", "model.mlp_layers=[8, 4]"])
    again = load_config(write(tmp_path, cfg.to_toml()))
    assert again == cfg


def test_unknown_key_suggests_closest(tmp_path):
    msg = error_of(load_config, write(tmp_path, "[train]\nstpes = 10\n"))
    assert "cfg.toml" in msg and "unknown key train.stpes" in msg and "did you mean train.steps?" in msg


def test_unknown_model_key_suggests_closest():
    msg = error_of(load_config, None, ["model.n_layr=3"])
    assert "--set" in msg and "model.n_layr" in msg and "did you mean model.n_layer?" in msg


def test_unknown_section(tmp_path):
    msg = error_of(load_config, write(tmp_path, "[trian]\nsteps = 10\n"))
    assert "unknown section [trian]" in msg and "did you mean train" in msg


def test_wrong_type_names_file_key_value(tmp_path):
    msg = error_of(load_config, write(tmp_path, '[train]\nsteps = "ten"\n'))
    assert "cfg.toml" in msg and "train.steps" in msg and "'ten'" in msg and "integer" in msg


def test_out_of_range_names_allowed_range(tmp_path):
    msg = error_of(load_config, write(tmp_path, "[train]\nlr = -0.1\n"))
    assert "train.lr = -0.1" in msg and "greater than 0" in msg


def test_literal_lists_choices():
    msg = error_of(load_config, None, ["precision.dtype=fp4"])
    assert "precision.dtype = 'fp4'" in msg and "'bf16'" in msg and "'fp8'" in msg and "--set" in msg


def test_bad_override_syntax():
    assert "section.key=value" in error_of(load_config, None, ["steps=3"])
    assert "section.key=value" in error_of(load_config, None, ["model..x=3"])


def test_a_deeper_override_sets_one_key_of_a_table(tmp_path):
    """A Hugging Face model's inline config shrinks by width and depth; the file's other keys stay."""
    path = write(tmp_path, '[model]\nname = "hf"\n[model.config]\nmodel_type = "llama"\nhidden_size = 4096\n'
                           "rope_theta = 500000.0\n")
    cfg = load_config(path, ["model.config.hidden_size=64", "model.config.num_hidden_layers=2"])
    assert cfg.model.config == {"model_type": "llama", "hidden_size": 64, "rope_theta": 500000.0,
                                "num_hidden_layers": 2}
    assert load_config(None, ['model.name="hf"', "model.config.model_type=llama"]).model.config == \
        {"model_type": "llama"}  # a table the file does not have is made
    assert error_of(load_config, path, ["model.name.x=1"]) == \
        "--set 'model.name.x=1': model.name is not a table, so it has no key x; set model.name itself"


def test_unknown_model_name():
    msg = error_of(load_config, None, ["model.name=transformerz"])
    assert 'unknown model.name = "transformerz"' in msg and "gpt" in msg


def test_user_model_that_cannot_be_imported():
    msg = error_of(load_config, None, ["model.name=no_such_pkg.mod:build"])
    assert "cannot import no_such_pkg.mod" in msg


def test_user_model_options_pass_through(tmp_path, monkeypatch):
    (tmp_path / "mymodel.py").write_text("def build(cfg, spec):\n    raise RuntimeError\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ['model.name="mymodel:build"', "model.hidden=64"])
    assert cfg.model.hidden == 64


def test_model_data_mismatch():
    msg = error_of(load_config, None, ["model.name=resnet"])
    assert 'cannot train on data.source = "stdlib-text"' in msg and "synthetic-images" in msg


def test_text_source_needs_path():
    assert "needs data.path" in error_of(load_config, None, ["data.source=text"])


def test_heads_must_divide_width():
    msg = error_of(load_config, None, ["model.n_head=3", "model.d_model=128"])
    assert "model.n_head (3) must divide model.d_model (128)" in msg


def test_layout_keys_that_need_another_key():
    assert "parallel.sequence_parallel = true splits the sequence over the tp ranks, but tp = 1" in error_of(
        load_config, None, ["parallel.sequence_parallel=true"])


def test_missing_config_file(tmp_path):
    assert "does not exist" in error_of(load_config, tmp_path / "nope.toml")


def test_invalid_toml(tmp_path):
    assert "not valid TOML" in error_of(load_config, write(tmp_path, "[train\nsteps=1"))


def test_section_must_be_table():
    assert "must be a [train] table" in error_of(validate_config, {"train": 3})


@pytest.mark.parametrize("overrides,words", [
    (['comm.compression="int8"', "parallel.tp=2"], ["parallel.tp = 2", 'comm.compression = "int8"', '"none"', "diloco"]),
    (['comm.compression="topk"', "parallel.pp=2"], ["pp = 2", "comm.compression"]),
    (['comm.compression="powersgd"', "parallel.zero=3"], ["parallel.zero = 3", "powersgd", "zero <= 1"]),
    (['comm.compression="int4"', "parallel.tp=2"], ["parallel.tp = 2", 'comm.compression = "int4"', "diloco"]),
    (['sync.mode="parameter-server"', 'comm.compression="int4"'], ['comm.compression = "int4"', "parameter server",
                                                                    'comm.compression = "none"']),
    (['sync.mode="diloco"', "sync.every=4", "sync.fragments=2", "sync.fragment_delay=1", 'comm.compression="powersgd"'],
     ['"powersgd"', "sync.fragment_delay = 1", '"int4"', "fragment_delay = 0"]),
    (['sync.mode="diloco"', "parallel.zero=2"], ['sync.mode = "diloco"', "sync.replicas", "zero = 0"]),
    (['sync.replicas=2'], ["sync.replicas = 2", "every-step"]),
    (['sync.mode="parameter-server"', 'train.on_bad_step="rollback"'], ['"skip"', "train.on_bad_step"]),
    (['sync.mode="parameter-server"', "parallel.tp=2"], ["parallel.tp = 1"]),
    (['comm.compression="gzip"'], ["comm.compression", "'none'", "'powersgd'"]),
    (["comm.topk_ratio=0"], ["comm.topk_ratio", "greater than 0"]),
    (["sync.every=0"], ["sync.every", "greater than or equal to 1"]),
])
def test_compression_and_sync_combinations_refused_in_one_line(overrides, words):
    msg = error_of(load_config, None, overrides)
    assert msg.startswith("--set: "), msg
    for w in words:
        assert w in msg, (w, msg)


def test_compression_and_sync_combinations_accepted():
    for overrides in (['comm.compression="powersgd"', "parallel.zero=1"], ['comm.compression="int8"', "parallel.zero=3"],
                      ['sync.mode="diloco"', "parallel.tp=2", 'comm.compression="int8"'],
                      ['sync.mode="local-sgd"', "parallel.pp=2"], ['train.optimizer="sgd"', "train.momentum=0.9"]):
        load_config(None, overrides)


def test_a_key_that_moved_is_refused_naming_its_new_place(tmp_path):
    """[parallel] once held the step synchronisation, the parameter server and the batch balancing; a file
    or --set with the old key gets one line naming the new key and how to write it."""
    msg = error_of(load_config, write(tmp_path, '[parallel]\ntp = 1\nsync = "diloco"\n'))
    assert msg == f'{tmp_path / "cfg.toml"}: parallel.sync is now sync.mode; write it as mode = "diloco" under [sync]'
    msg = error_of(load_config, None, ["parallel.ps_mode=async"])
    assert msg == '--set: parallel.ps_mode is now ps.mode; use --set ps.mode="async"'
    assert error_of(load_config, None, ["parallel.balance_interval=5"]).endswith("use --set balance.interval=5")


def test_a_stored_config_with_moved_keys_is_migrated_on_read(tmp_path):
    """What shoal itself wrote before the move (a run dir's config.toml) loads with every old key in its
    new place, and equals the config written with the new keys."""
    from conftest import FIXTURES

    old = load_config(FIXTURES / "old_keys" / "config.toml", stored=True)
    assert (old.sync.mode, old.sync.every, old.ps.mode, old.balance.mode) == ("diloco", 2, "sync", "uniform")
    new = load_config(write(tmp_path, old.to_toml()))
    assert new == old and "sync_every" not in old.to_toml()
    with pytest.raises(UserError, match="parallel.sync is now sync.mode"):  # the same file, given by a user
        load_config(FIXTURES / "old_keys" / "config.toml")


@pytest.mark.parametrize("value", [-1, 65, "two", True])
def test_data_prefetch_is_a_count_or_auto(value):
    with pytest.raises(ValueError, match="data.prefetch"):
        DataConfig(prefetch=value)
    assert DataConfig().prefetch == "auto" and DataConfig(prefetch=0).prefetch == 0
