"""The package root re-exports the public surface, and ``__all__`` says exactly what it is."""

import inspect
import subprocess
import sys

import kvcascade as kc


def test_all_names_resolve_and_are_documented() -> None:
    assert len(set(kc.__all__)) == len(kc.__all__)
    for name in kc.__all__:
        obj = getattr(kc, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert inspect.getdoc(obj), f"{name} has no docstring"


def test_every_public_root_attribute_is_listed() -> None:
    public = {n for n, v in vars(kc).items() if not n.startswith("_") and not inspect.ismodule(v)}
    assert public <= set(kc.__all__), sorted(public - set(kc.__all__))


def test_optional_integrations_are_not_imported_eagerly() -> None:
    """S3 and vLLM support stay optional: importing kvcascade imports neither."""
    code = "import sys, kvcascade; print('aiobotocore' in sys.modules, 'vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
