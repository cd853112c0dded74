"""k3train.data, k3train.optim and k3train.checkpoint export their names lazily (so that their
config modules load without torch): every exported name must resolve to its submodule's object."""

import importlib

import pytest


@pytest.mark.parametrize("package", ["k3train.data", "k3train.optim", "k3train.checkpoint"])
def test_lazy_exports_resolve(package):
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(module._SUBMODULE_OF)
    for name in module.__all__:
        assert getattr(module, name) is getattr(importlib.import_module(module._SUBMODULE_OF[name]), name)
    assert set(module.__all__) <= set(dir(module))
    with pytest.raises(AttributeError):
        _ = module.no_such_name
