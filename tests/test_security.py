"""No code execution from files: nothing s2s reads can run code when loaded."""

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "s2s"

FORBIDDEN = [
    (r"\bimport pickle\b|\bfrom pickle\b|\bcPickle\b|\bdill\b", "pickle"),
    (r"\byaml\.(unsafe_)?load\((?![^)]*Loader=YAML_LOADER\))|yaml\.full_load|yaml\.C?(Full|Unsafe)?Loader\b",
     "yaml.load but with s2s.config.YAML_LOADER (use yaml.safe_load)"),
    (r"(?<![.\w])(?<!def )(eval|exec)\(", "eval/exec"),  # a method named eval (nn.Module's) is no eval
    (r"\bnp\.load\([^)]*allow_pickle\s*=\s*True", "np.load(allow_pickle=True)"),
]


def test_no_unsafe_deserialization_in_the_package():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for pattern, what in FORBIDDEN:
            for m in re.finditer(pattern, text):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{text[:m.start()].count(chr(10)) + 1}: {what}")
        for m in re.finditer(r"\btorch\.load\(([^)]*)\)", text):
            if "weights_only=True" not in m.group(1):
                found.append(f"{path.relative_to(PACKAGE.parent)}: torch.load without weights_only=True")
    assert not found, "\n".join(found)


def test_the_yaml_loader_constructs_no_python_objects():
    """s2s.config.YAML_LOADER, the one yaml.load may take: PyYAML's safe loader (libyaml's or Python's)."""
    import pytest
    import yaml

    from s2s.config import YAML_LOADER

    assert YAML_LOADER in (yaml.SafeLoader, getattr(yaml, "CSafeLoader", None))
    assert not issubclass(YAML_LOADER, yaml.constructor.FullConstructor)
    with pytest.raises(yaml.constructor.ConstructorError):
        yaml.load("!!python/object/apply:os.getpid []", Loader=YAML_LOADER)
    assert yaml.load("a: [1, 2]", Loader=YAML_LOADER) == {"a": [1, 2]}


def test_checkpoints_and_models_hold_no_pickles(tmp_path, prepared):
    """Every file training writes is safetensors, JSON, YAML, text or a SentencePiece protobuf."""
    from s2s.config import load_config
    from s2s.trainer import train

    run = train(load_config(prepared, ["train.max_steps=2", "train.validate_every=2"]), tmp_path / "run",
                show_progress=False)
    for f in run.rglob("*"):
        if f.is_file():
            assert f.suffix in {".safetensors", ".json", ".jsonl", ".yaml", ".model", ".lock"}, f
            assert not f.read_bytes().startswith(b"\x80"), f"{f} looks like a pickle"
