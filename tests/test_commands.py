"""The installed package: its console commands, its one top-level module, and TensorFlow's CPU kernels.

The commands run in subprocesses, as a user runs them: a command must choose TensorFlow's
CPU kernels before TensorFlow loads, which an in-process test (TensorFlow long loaded)
cannot show.
"""

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 180

# Each console command and the repository command it stands for.
COMMANDS = {
    "kt-train": [sys.executable, "train.py"],
    "kt-translate": [sys.executable, "translate.py"],
    "kt-export": [sys.executable, "-m", "export"],
    "kt-client": [sys.executable, "-m", "export.client"],
}


def _run(command, env=None):
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT, env=env)


def _flags(help_text):
    return sorted({word.rstrip(",.]") for word in help_text.split() if word.startswith("--")})


def test_the_package_installs_one_top_level_module_and_the_four_commands():
    distribution = importlib.metadata.distribution("keras-transformer")
    assert distribution.read_text("top_level.txt").split() == ["keras_transformer"]
    scripts = {entry.name: entry.value for entry in distribution.entry_points if entry.group == "console_scripts"}
    assert scripts == {
        "kt-train": "keras_transformer.cli.train:main",
        "kt-translate": "keras_transformer.cli.translate:main",
        "kt-export": "keras_transformer.cli.export:main",
        "kt-client": "keras_transformer.cli.client:main",
    }


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_takes_the_flags_of_the_repository_command(command):
    if shutil.which(command) is None:
        pytest.skip(f"{command} is not on PATH: the package is not installed (pip install -e .)")
    env = {name: value for name, value in os.environ.items() if name != "TF_CPP_MIN_LOG_LEVEL"}
    installed, repository = _run([command, "--help"], env=env), _run(COMMANDS[command] + ["--help"], env=env)
    assert installed.returncode == 0 and repository.returncode == 0, installed.stderr[-2000:]
    assert _flags(installed.stdout) == _flags(repository.stdout) and len(_flags(installed.stdout)) > 5
    # TensorFlow's C++ info lines after its start-up, as this one, are quieted (keras_transformer.cli).
    assert "cpu_feature_guard" not in installed.stderr + repository.stderr


@pytest.mark.slow
def test_kt_train_reports_a_bad_command_in_one_line_under_its_own_name(tmp_path):
    if shutil.which("kt-train") is None:
        pytest.skip("kt-train is not on PATH: the package is not installed (pip install -e .)")
    result = _run(["kt-train", "--run-dir", str(tmp_path / "run"), "--preset", "tiny", "--patience", "2"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("kt-train: error: --patience 2 counts validations")
    assert not (tmp_path / "run").exists()


_IMPORTS = """
import os, sys
import keras_transformer
from keras_transformer import cpu_kernels
print("tensorflow" in sys.modules, cpu_kernels.configure(), os.environ.get("TF_ENABLE_ONEDNN_OPTS"))
from tensorflow.python.util import _pywrap_util_port
print(_pywrap_util_port.IsMklEnabled(), cpu_kernels.configure())
"""


@pytest.mark.slow
def test_importing_the_package_leaves_the_cpu_kernels_to_the_command():
    """`import keras_transformer` loads no TensorFlow, so `cpu_kernels.configure()` after it still takes effect."""
    env = {name: value for name, value in os.environ.items() if name != "TF_ENABLE_ONEDNN_OPTS"}
    result = _run([sys.executable, "-c", _IMPORTS], env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    first, second = (line.split() for line in result.stdout.strip().splitlines()[-2:])
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    assert first == ["False", "True", "1" if x86 else "None"]
    assert second[1] == "False"  # Too late once TensorFlow is loaded.
    if x86:
        assert second[0] == "True"  # oneDNN on, whatever this CPU would have had by default.
