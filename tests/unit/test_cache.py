"""k3train's cache directory (k3train/cache.py): one variable, K3TRAIN_CACHE_DIR, moves the
corpus and the matmul-peak file alike; the corpus's old K3TRAIN_CACHE still works, with a line."""

from pathlib import Path

import pytest

from k3train.cache import cache_dir, locate_cache


@pytest.mark.parametrize(
    "environ, expected, source",
    [
        (
            {"K3TRAIN_CACHE_DIR": "/c/new", "K3TRAIN_CACHE": "/c/old", "XDG_CACHE_HOME": "/x"},
            "/c/new",
            "K3TRAIN_CACHE_DIR",
        ),
        ({"K3TRAIN_CACHE": "/c/old", "XDG_CACHE_HOME": "/x"}, "/c/old", "K3TRAIN_CACHE"),
        ({"XDG_CACHE_HOME": "/x"}, "/x/k3train", "XDG_CACHE_HOME"),
        ({}, str(Path.home() / ".cache" / "k3train"), "default"),
    ],
)
def test_order_of_the_sources(environ, expected, source):
    location = locate_cache(None, environ)
    assert (str(location.path), location.source) == (expected, source)
    assert (location.deprecation is not None) == (source == "K3TRAIN_CACHE")


def test_the_old_variable_says_what_to_set_instead():
    line = locate_cache(None, {"K3TRAIN_CACHE": "/c/old"}).deprecation
    assert line.startswith("warning: K3TRAIN_CACHE is deprecated") and "K3TRAIN_CACHE_DIR" in line and "\n" not in line


def test_configured_directory_wins():
    assert locate_cache("~/mine", {"K3TRAIN_CACHE_DIR": "/c/new"}).path == Path.home() / "mine"


@pytest.mark.parametrize("variable", ["K3TRAIN_CACHE_DIR", "K3TRAIN_CACHE"])
def test_corpus_and_matmul_peak_share_the_directory(tmp_path, monkeypatch, variable):
    from k3train.data.corpus import resolve_cache_dir
    from k3train.training import throughput

    for name in ("K3TRAIN_CACHE_DIR", "K3TRAIN_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, str(tmp_path))
    assert resolve_cache_dir() == cache_dir() == tmp_path
    tflops, source = throughput.cached_cpu_peak(threads=1, measure=lambda: 1.5)
    assert tflops == 1.5 and (tmp_path / throughput.CPU_PEAK_CACHE_FILE).is_file(), source
