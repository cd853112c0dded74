"""tools/setup_env.sh is sourced into the user's shell: it must leave the shell as it found it,
and pick the CPU build of torch on a machine without a GPU. python, pip and nvidia-smi are stubs
here, so nothing is installed."""

import pathlib
import subprocess

import pytest

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]

STUB_PYTHON = """#!/bin/bash
echo "python $*" >> "$STUB_LOG"
case "$*" in *python-check*) exit "${PYTHON_CHECK_RC:-0}";; esac
if [ "$1" = "-c" ]; then exit "${TORCH_IMPORT_RC:-0}"; fi
case "$*" in *"torch==2.13.0+cpu"*) exit "${LOCAL_WHEEL_RC:-0}";; esac
exit 0
"""


@pytest.fixture
def stub_env(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in {"python": STUB_PYTHON, "pip": "#!/bin/bash\nexit 0\n"}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "STUB_LOG": str(tmp_path / "log"), "HOME": str(tmp_path)}
    return bin_dir, env


def add_nvidia_smi(bin_dir: pathlib.Path, rc: int) -> None:
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/bash\nexit {rc}\n")
    (bin_dir / "nvidia-smi").chmod(0o755)


def run_bash(script: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], cwd=CHECKOUT, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("options", ["set +e +u", "set -euo pipefail", "set -u +e"])
def test_sourcing_leaves_the_shell_options_as_found(stub_env, options):
    _, env = stub_env
    before = run_bash(f"{options}; echo $-; set +o", env)
    after = run_bash(f"{options}; source tools/setup_env.sh; echo $-; set +o", env)
    assert before.returncode == 0 and after.returncode == 0, after.stderr
    assert after.stdout == before.stdout


def test_a_failing_command_after_sourcing_does_not_exit_the_shell(stub_env):
    _, env = stub_env
    result = run_bash("set +e +u; source tools/setup_env.sh; false; echo still here; echo ${UNSET_VARIABLE:-}ok", env)
    assert result.returncode == 0 and "still here\nok" in result.stdout, result.stderr


def test_no_thread_count_is_exported(stub_env):
    _, env = stub_env
    result = run_bash('source tools/setup_env.sh; echo "[${OMP_NUM_THREADS:-unset}]"', env)
    assert result.stdout.strip().endswith("[unset]")


def installs(env: dict) -> list[str]:
    return [line for line in pathlib.Path(env["STUB_LOG"]).read_text().splitlines() if "install" in line]


def test_cpu_machine_gets_the_local_cpu_wheel(stub_env):
    bin_dir, env = stub_env
    add_nvidia_smi(bin_dir, 9)  # present but failing: no driver, no GPU
    env["TORCH_IMPORT_RC"] = "1"
    assert run_bash("source tools/setup_env.sh", env).returncode == 0
    torch_installs = [line for line in installs(env) if "torch" in line and "numpy" not in line]
    assert torch_installs == ["python -m pip install --quiet torch==2.13.0+cpu"]


def test_cpu_machine_without_the_local_wheel_uses_the_cpu_index(stub_env):
    _, env = stub_env
    env.update(TORCH_IMPORT_RC="1", LOCAL_WHEEL_RC="1")
    assert run_bash("source tools/setup_env.sh", env).returncode == 0
    torch_installs = [line for line in installs(env) if "torch" in line and "numpy" not in line]
    assert torch_installs[-1] == (
        "python -m pip install --quiet torch --index-url https://download.pytorch.org/whl/cpu"
    )


def test_gpu_machine_gets_the_default_build(stub_env):
    bin_dir, env = stub_env
    add_nvidia_smi(bin_dir, 0)
    env["TORCH_IMPORT_RC"] = "1"
    assert run_bash("source tools/setup_env.sh", env).returncode == 0
    assert "python -m pip install --quiet torch" in installs(env)


def test_a_failed_install_stops_a_caller_under_set_e(stub_env):
    bin_dir, env = stub_env
    (bin_dir / "python").write_text("#!/bin/bash\nexit 1\n")
    result = run_bash("set -e; source tools/setup_env.sh; echo reached", env)
    assert result.returncode != 0 and "reached" not in result.stdout
    interactive = run_bash('set +e; source tools/setup_env.sh; echo "status $?"', env)
    assert "status 1" in interactive.stdout


STUB_PYTHON3_VENV = """#!/bin/bash
echo "python3 $*" >> "$STUB_LOG"
case "$*" in *python-check*) exit 0;; esac
if [ "$1 $2" = "-m venv" ]; then
    mkdir -p "$3/bin"
    printf '#!/bin/bash\\necho "venv-python $*" >> "$STUB_LOG"\\nexit 0\\n' > "$3/bin/python"
    chmod +x "$3/bin/python"
    printf 'export VIRTUAL_ENV="%s"\\nexport PATH="%s/bin:$PATH"\\n' "$3" "$3" > "$3/bin/activate"
fi
"""


def test_a_python_that_refuses_installs_gets_a_virtual_environment(stub_env, tmp_path):
    """PEP 668 (Debian's system Python): `.venv` is created once from python3 and activated in the
    caller's shell, and the installs go into it."""
    bin_dir, env = stub_env
    (bin_dir / "python3").write_text(STUB_PYTHON3_VENV)
    (bin_dir / "python3").chmod(0o755)
    env.update(PYTHON_CHECK_RC="3", K3TRAIN_VENV=str(tmp_path / "venv"))
    result = run_bash('source tools/setup_env.sh; echo "python=$(command -v python) [${__k3train_venv:-}]"', env)
    assert result.returncode == 0, result.stderr
    assert f"python={tmp_path / 'venv' / 'bin' / 'python'} []" in result.stdout
    assert "creating the virtual environment" in result.stderr
    assert "python3 -m venv" in pathlib.Path(env["STUB_LOG"]).read_text()
    again = run_bash("source tools/setup_env.sh; command -v python", env)  # reused, not created again
    assert again.stdout.strip() == str(tmp_path / "venv" / "bin" / "python") and "creating" not in again.stderr


def test_no_python_at_all_is_one_line_naming_the_fix(tmp_path):
    env = {"PATH": str(tmp_path), "HOME": str(tmp_path), "K3TRAIN_VENV": str(tmp_path / "venv")}
    result = subprocess.run(
        ["/bin/bash", "-c", "source tools/setup_env.sh"],
        cwd=CHECKOUT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "setup_env: no python or python3 on PATH; install Python 3.11+ (Debian: apt-get install python3 python3-venv)"
    ]


def test_an_old_python_is_refused_with_its_version(stub_env):
    _, env = stub_env
    env["PYTHON_CHECK_RC"] = "4"
    result = run_bash("source tools/setup_env.sh", env)
    assert result.returncode != 0 and "k3train needs Python 3.11+" in result.stderr
