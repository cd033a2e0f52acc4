"""Config files and overrides: every shipped config validates; bad input names the key and the file."""

from pathlib import Path

import pytest

from tenx import config as cfglib
from tenx.errors import ConfigError
from tenx.train.config import CONFIG_DIR, RunConfig, load_run_config

SHIPPED = sorted(CONFIG_DIR.glob("*.toml"))


def test_configs_are_shipped():
    assert {"quickstart", "tiny"} <= {p.stem for p in SHIPPED}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_parses_and_validates(path: Path):
    cfg = load_run_config(path)
    assert cfg.model.resolved(8192).d_model % 64 == 0
    # The resolved config written into run directories round-trips.
    text = cfglib.dumps_toml(cfg)
    assert cfglib.to_dict(cfglib.from_dict(RunConfig, cfglib.tomllib.loads(text))) == cfglib.to_dict(cfg)


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "bad.toml"
    p.write_text(text)
    return p


def test_unknown_key_names_key_file_and_allowed(tmp_path):
    p = write(tmp_path, "[model]\ndepht = 3\n[train]\nsteps = 5\n")
    with pytest.raises(ConfigError) as e:
        load_run_config(p)
    msg = str(e.value)
    assert "model.depht" in msg and str(p) in msg and "depth" in msg and "seq_len" in msg


def test_unknown_section(tmp_path):
    with pytest.raises(
        ConfigError, match="unknown key 'modle'.*allowed keys: checkpoint, data, faults, guard, log, model"
    ):
        load_run_config(write(tmp_path, "[modle]\ndepth = 3\n"))


def test_wrong_type_names_key_and_expected_type(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.steps: expected int, got 'ten'"):
        load_run_config(write(tmp_path, '[train]\nsteps = "ten"\n'))
    with pytest.raises(
        ConfigError, match=r"model\.norm: 'batchnorm' is not allowed; choose one of 'layernorm', 'rmsnorm'"
    ):
        load_run_config(write(tmp_path, '[model]\nnorm = "batchnorm"\n[train]\nsteps = 1\n'))


def test_validate_names_field(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.n_kv_heads: n_heads=4 must be a multiple of n_kv_heads=3"):
        load_run_config(None, ["train.steps=1", "model.depth=4", "model.n_kv_heads=3"])
    with pytest.raises(ConfigError, match=r"train\.steps: set train.steps or train.tokens"):
        load_run_config(None, [])
    with pytest.raises(ConfigError, match=r"optim\.lr: must be > 0"):
        load_run_config(None, ["train.steps=1", "optim.lr=0"])


def test_overrides_typed_and_dotted():
    cfg = load_run_config(
        SHIPPED[0], ["optim.lr=1e-4", "model.family=llama", 'data.dir="x/y"', "train.compile=true"]
    )
    assert (
        cfg.optim.lr == 1e-4 and cfg.model.family == "llama" and cfg.data.dir == "x/y" and cfg.train.compile
    )
    cfg = load_run_config(SHIPPED[0], ["data.dir=bare/string"])
    assert cfg.data.dir == "bare/string"
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        load_run_config(SHIPPED[0], ["optim.lr"])


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_run_config(tmp_path / "nope.toml")


def test_describe_lists_every_field_with_help():
    rows = cfglib.describe(RunConfig)
    keys = {r[0] for r in rows}
    assert {"model.depth", "optim.lr", "train.steps", "data.dir", "checkpoint.every"} <= keys
    assert all(r[3] for r in rows), [r[0] for r in rows if not r[3]]


def test_docs_field_reference_is_current():
    """docs/config.md embeds tenx.config.field_reference(RunConfig) verbatim: every field, current help."""
    docs = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    assert cfglib.field_reference(RunConfig) in docs, (
        "docs/config.md is out of date: paste tenx.config.field_reference(RunConfig) into its Field reference"
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.depth=0", r"model\.depth: must be >= 1, got 0"),
        ("parallel.replicas.groups=0", r"parallel\.replicas\.groups: must be >= 1, got 0"),
        ("parallel.replicas.manager_port=65536", r"manager_port: must be in \[0, 65536\), got 65536"),
        ("optim.decay_fraction=0", r"optim\.decay_fraction: must be in \(0, 1\], got 0\.0"),
        ("optim.lr=nan", r"optim\.lr: must be a finite number, got nan"),
        ("optim.lr=inf", r"optim\.lr: must be a finite number, got inf"),
        ("checkpoint.every=-1", r"checkpoint\.every: must be >= 0 or 'auto', got -1"),
    ],
)
def test_field_bounds_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(None, ["train.steps=1", override])


def test_bounds_checked_on_trees_built_in_python():
    cfg = load_run_config(None, ["train.steps=1", "checkpoint.every='auto'"])  # 'auto' is not bounded
    assert cfg.model.d_model is None  # an unset optional field is not bounded either
    cfg.parallel.replicas.bucket_mb = 0.0
    with pytest.raises(ConfigError, match=r"parallel\.replicas\.bucket_mb: must be > 0"):
        cfglib.check_bounds(cfg)
    with pytest.raises(ConfigError, match=r"parallel\.replicas\.bucket_mb: must be > 0"):
        cfglib.validate_tree(cfg)


def test_config_flags_round_trip():
    import argparse

    from tenx.scaling.ladder.rungs import LadderConfig

    parser = argparse.ArgumentParser()
    fields = ("grid", "tokens_per_param", "unique_tokens", "seeds")
    cfglib.add_config_arguments(parser, LadderConfig, fields)
    args = parser.parse_args(["--grid", "ratio", "--tokens-per-param", "10"])
    lc = cfglib.config_from_args(LadderConfig, args, fields)
    assert (lc.grid, lc.tokens_per_param, lc.unique_tokens, lc.seeds) == ("ratio", 10.0, None, 1)
    assert lc == LadderConfig(grid="ratio", tokens_per_param=10.0)
    with pytest.raises(SystemExit):
        parser.parse_args(["--grid", "cube"])  # choices come from the Literal


def _nodes(cfg, where=""):
    import dataclasses

    yield where, cfg
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            yield from _nodes(value, f"{where}.{f.name}" if where else f.name)


def test_a_config_section_is_named_once_and_where_the_tree_puts_it():
    """A config validated on its own names its section (SECTION) as the trees that hold it do."""
    from tenx.scaling.derisk.compute_multiplier import DeriskConfig

    sections = {}
    for tree in (RunConfig(), DeriskConfig()):
        for where, node in _nodes(tree):
            if hasattr(node, "SECTION"):
                sections[type(node).__name__] = (node.SECTION, where)
    assert {"ModelConfig", "LadderConfig"} <= set(sections)
    assert all(section == where for section, where in sections.values()), sections
    hand_typed = [
        str(p.relative_to(Path(cfglib.__file__).parents[1]))
        for p in Path(cfglib.__file__).parent.rglob("*.py")
        if "check_bounds(self, " in p.read_text()
    ]
    assert not hand_typed, f"name the section once (SECTION), not in check_bounds: {hand_typed}"


def test_supervisor_section_flags_and_docs(capsys):
    """`tenx train`'s supervisor flags come from SupervisorConfig, checked by its bounds; the docs list each."""
    import dataclasses

    from tenx.cli import main
    from tenx.commands.cli import SUPERVISOR_FLAG_NAMES, SUPERVISOR_FLAGS
    from tenx.config import bounds_text
    from tenx.launch.supervise import SupervisorConfig

    with pytest.raises(ConfigError, match=r"supervisor\.backoff_s: must be >= 0, got -1\.0"):
        SupervisorConfig(backoff_s=-1.0).validate()
    docs = (Path(__file__).resolve().parents[1] / "docs" / "fault-tolerance.md").read_text()
    for f in dataclasses.fields(SupervisorConfig):
        flag = SUPERVISOR_FLAG_NAMES.get(f.name, "--" + f.name.replace("_", "-"))
        flag = f"`{flag}`" if f.name in SUPERVISOR_FLAGS else "(Python only)"
        row = f"| {flag} | `{f.name}` | {bounds_text(f)} | `{f.default!r}` | {f.metadata['help']} |"
        assert row in docs, f"docs/fault-tolerance.md's [supervisor] table lacks or misstates:\n{row}"
    argv = ["train", "--config", "tiny", "--set", "train.steps=1", "--supervise", "--max-restarts", "-1"]
    assert main(argv) == 2  # before any child starts
    assert "tenx: error: supervisor.max_restarts: must be >= 0, got -1" in capsys.readouterr().err


def test_set_steps_replaces_a_token_budget_and_the_reverse(tmp_path):
    """`--set train.steps=N` shortens a config that sets train.tokens (and the reverse); both at once on the
    command line are still refused, naming the field."""
    from tenx.train.config import load_run_config

    path = tmp_path / "budget.toml"
    path.write_text("[train]\ntokens = 1000000\n\n[optim]\nlr = 1e-3\n")
    cfg = load_run_config(path, ["train.steps=40"])
    assert (cfg.train.steps, cfg.train.tokens) == (40, None)
    path.write_text("[train]\nsteps = 2000\n")
    cfg = load_run_config(path, ["train.tokens=4096"])
    assert (cfg.train.steps, cfg.train.tokens) == (None, 4096)
    with pytest.raises(ConfigError, match=r"train\.steps: set only one of train.steps and train.tokens"):
        load_run_config(path, ["train.tokens=4096", "train.steps=3"])
    path.write_text("[train]\nsteps = 2000\ntokens = 5\n")  # both in the file: still the user's mistake
    with pytest.raises(ConfigError, match=r"set only one of train.steps and train.tokens"):
        load_run_config(path, ["optim.lr=1e-3"])
