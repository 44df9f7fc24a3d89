"""The installed package: import names, light imports, console script."""

import subprocess
import sys
from pathlib import Path


def run_python(code, tmp_path):
    # Run outside the checkout so that only installed packages are importable.
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)


def test_patches_and_launch_are_not_top_level_names(tmp_path):
    result = run_python(
        "import importlib.util as u, mover_plugin.patches, mover_plugin.launch.cli; "
        "print(u.find_spec('patches'), u.find_spec('launch'))",
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["None", "None"]


def test_importing_mover_plugin_imports_no_framework(tmp_path):
    result = run_python(
        "import sys, mover_plugin, mover_plugin.patches; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'megatron', 'deepspeed'}))",
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_console_script_is_installed():
    launcher = Path(sys.executable).with_name("mover-launch")
    result = subprocess.run([str(launcher), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "--nproc-per-node" in result.stdout and "--inject-failure" in result.stdout


def test_the_megatron_training_extra_installs_what_megatron_training_imports(tmp_path):
    # megatron-core's wheel carries megatron.training; the [megatron-training] extra brings
    # what it imports. Its training loop's hook points are module globals looked up at call time.
    result = run_python(
        "import warnings; warnings.simplefilter('ignore'); "
        "import megatron.training.training as t, megatron.training.arguments as a; "
        "print(callable(t.pretrain), callable(t.train_step), callable(a.parse_and_validate_args))",
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-3:] == ["True", "True", "True"]
