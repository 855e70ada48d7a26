from dataclasses import dataclass, field

import pytest

from treepo_ray import config


@dataclass
class Inner:
    x: int = 1
    y: float | None = None
    name: str = "a"
    items: list[int] = field(default_factory=lambda: [1, 2])


@dataclass
class Outer:
    inner: Inner = field(default_factory=Inner)
    flag: bool = False


def test_overrides_are_typed():
    cfg = config.apply_overrides(Outer(), ["inner.x=5", "inner.y=0.5", "flag=true", "inner.items=[3,4]", "inner.name=b"])
    assert cfg == Outer(Inner(x=5, y=0.5, name="b", items=[3, 4]), flag=True)
    assert config.apply_overrides(Outer(), ["inner.y=null"]).inner.y is None


@pytest.mark.parametrize(
    "bad, message",
    [("inner.z=1", "unknown key 'z'"), ("inner.x=1.5", "expected an integer"), ("nope.x=1", "unknown key .nope."), ("inner.x.y=1", "not a section"),
     ("flag=maybe", "true or false"), ("flag", "key=value")],
)
def test_bad_overrides_name_the_key(bad, message):
    with pytest.raises(ValueError, match=message):
        config.apply_overrides(Outer(), [bad])


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("inner:\n  x: 7\nflag: true\n")
    cfg = config.load(Outer, path, ["inner.name=z"])
    assert (cfg.inner.x, cfg.inner.name, cfg.flag, cfg.inner.items) == (7, "z", True, [1, 2])
    path.write_text("inner:\n  typo: 7\n")
    with pytest.raises(ValueError, match="typo"):
        config.load(Outer, path)


@dataclass
class WithMapping:
    inner: Inner = field(default_factory=Inner)
    kwargs: dict = field(default_factory=dict)


def test_free_form_mappings_take_any_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("kwargs:\n  block_size: 32\ninner:\n  x: 2\n")
    cfg = config.load(WithMapping, path, ["kwargs.device=cpu", "inner.name=q"])
    assert cfg.kwargs == {"block_size": 32, "device": "cpu"} and (cfg.inner.x, cfg.inner.name) == (2, "q")
    with pytest.raises(ValueError, match="unknown key 'nope'"):
        config.load(WithMapping, None, ["inner.nope=1"])


def test_a_yaml_file_goes_through_the_same_dotted_overrides(tmp_path):
    data = {"kwargs": {"block_size": 32}, "inner": {"x": 2, "name": "q: r", "items": [3]}}
    args = config.file_overrides(WithMapping, data)
    # Sections are walked into, a free-form mapping is one override (set whole).
    assert [a.split("=")[0] for a in args] == ["kwargs", "inner.x", "inner.name", "inner.items"]
    assert config.apply_overrides(WithMapping(), args) == WithMapping(Inner(x=2, name="q: r", items=[3]),
                                                                      {"block_size": 32})
    path = tmp_path / "c.yaml"
    path.write_text("inner:\n  typo: 7\n")
    with pytest.raises(ValueError, match=r"c.yaml: .*unknown key 'typo'"):
        config.read_file_overrides(WithMapping, path)
    path.write_text("- 1\n")
    with pytest.raises(ValueError, match="c.yaml: expected a mapping of config sections, got list"):
        config.load(WithMapping, path)
    assert config.read_file_overrides(WithMapping, None) == []


@pytest.mark.parametrize("value", ["nan", "NaN", ".nan", "inf", "-inf", ".inf", "1e999"])
def test_a_float_must_be_finite(tmp_path, value):
    """NaN slips past every range check (`nan <= 0` is False) and inf is no limit: refused for a plain float, an
    optional one (its own message, not "cannot read") and in a YAML file (named)."""
    with pytest.raises(config.UserError, match=r"^inner.y: expected a finite number, got"):
        config.apply_overrides(Outer(), [f"inner.y={value}"])
    path = tmp_path / "c.yaml"
    path.write_text(f"inner:\n  y: {value}\n")
    with pytest.raises(config.UserError, match=rf"^{path}: inner.y: expected a finite number"):
        config.load(Outer, path)
    assert config.apply_overrides(Outer(), ["inner.y=-1.5e3"]).inner.y == -1500.0


@dataclass
class Floats:
    rate: float = 0.5
    rates: list[float] = field(default_factory=list)


def test_finite_floats_in_lists_and_wrong_types_named():
    with pytest.raises(config.UserError, match=r"^rates\[1\]: expected a finite number, got 'nan'"):
        config.apply_overrides(Floats(), ["rates=[0.1, nan]"])
    with pytest.raises(config.UserError, match=r"^rate: expected a number, got 'fast'"):
        config.apply_overrides(Floats(), ["rate=fast"])
    with pytest.raises(config.UserError, match=r"^inner.y: expected a number, got 'x'"):
        config.apply_overrides(Outer(), ["inner.y=x"])


@pytest.mark.parametrize("bad, said", [
    ("inner.nmae=b", "unknown key 'nmae' in inner; did you mean inner.name?"),
    ("x=1", "unknown key 'x'; did you mean inner.x?"),  # the right name in the wrong section
    ("inner.zzz=1", "unknown key 'zzz' in inner; `treepo-ray train --print-config inner` lists its keys"),
    ("zzz.qqq=1", "unknown key 'zzz'; the top-level keys are inner, flag"),
    ("zzz.x=1", "unknown key 'zzz'; did you mean inner.x?"),  # the right name under a wrong section
])
def test_an_unknown_key_names_the_closest_keys_not_every_key(bad, said):
    with pytest.raises(config.UnknownKey) as err:
        config.apply_overrides(Outer(), [bad])
    assert str(err.value) == f"override {bad!r}: {said}" and err.value.key == bad.split("=")[0]


def test_select_prints_only_the_keys_asked_for():
    data = config.to_dict(Outer())
    assert config.select(Outer, data, ["inner.x", "flag"]) == {"inner": {"x": 1}, "flag": False}
    assert config.select(Outer, data, []) == data
    with pytest.raises(config.UnknownKey, match="did you mean inner.items"):
        config.select(Outer, data, ["inner.itemz"])


def test_a_refused_value_says_where_each_key_it_names_came_from():
    from treepo_ray.tree import TreePOConfig

    @dataclass
    class Job:
        treepo: TreePOConfig = field(default_factory=TreePOConfig)

    args = ["treepo.init_divergence_min=4", "treepo.init_divergence_max=8", "treepo.width=4"]
    with pytest.raises(config.UserError) as plain:
        config.load(Job, None, args)
    assert "[" not in str(plain.value)  # outside key_origins: the section's own message, as before
    with config.key_origins({"treepo.init_divergence_min": "from a.yaml", "treepo.width": "command line"}):
        with pytest.raises(config.UserError) as err:
            config.load(Job, None, args)
    said = str(err.value)
    assert said.startswith(str(plain.value))
    assert ("[treepo.width = 4 (command line); treepo.init_divergence_min = 4 (from a.yaml); "
            "treepo.init_divergence_max = 8 (default)]") in said
    assert "treepo.init_divergence =" not in said  # a key whose name is a prefix of a named one is not named


def test_an_invalid_file_names_the_file_and_each_key_with_its_origin(tmp_path):
    from treepo_ray.tree import TreePOConfig

    @dataclass
    class Job:
        treepo: TreePOConfig = field(default_factory=TreePOConfig)

    path = tmp_path / "job.yaml"
    path.write_text("treepo:\n  init_divergence: 20\n")
    with pytest.raises(config.UserError) as err:
        config.load(Job, path)
    assert str(err.value).startswith(f"{path}: ")
    assert f"treepo.init_divergence = 20 (from {path})" in str(err.value)
    assert "treepo.width = 16 (default)" in str(err.value)
