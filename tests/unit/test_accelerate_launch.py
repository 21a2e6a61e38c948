"""megatron.training.accelerate_launch: what it refuses (one line), what it reads from an
accelerate config, and that its three answers reach Accelerate's own modules on CPU."""

import importlib.metadata
import subprocess
import sys
import textwrap

import pytest

from megatron.training import accelerate_launch as launch
from tests.helpers.paths import ROOT

pytest.importorskip("accelerate")


def _run(args, env_extra=None, cwd=None):
    import os

    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "megatron.training.accelerate_launch", *args],
                          capture_output=True, text=True, cwd=cwd or ROOT, env=env, timeout=300)


def test_an_untested_accelerate_version_is_refused_in_one_line(monkeypatch):
    real = importlib.metadata.version

    def fake(name):
        return "1.9.0" if name == "accelerate" else real(name)

    monkeypatch.setattr(importlib.metadata, "version", fake)
    with pytest.raises(launch.AccelerateLaunchError, match=r"accelerate 1\.9\.0 is installed; the CPU launcher is "
                                                           r"tested with accelerate 1\.16\.0 only"):
        launch.check_accelerate_version()


def test_the_installed_accelerate_is_a_tested_one():
    assert launch.check_accelerate_version() in launch.TESTED_ACCELERATE_VERSIONS


def test_an_accelerate_config_gives_the_environment_accelerate_launch_gives(tmp_path):
    config = tmp_path / "megatron.yaml"
    config.write_text(textwrap.dedent("""\
        compute_environment: LOCAL_MACHINE
        distributed_type: MEGATRON_LM
        mixed_precision: bf16
        num_processes: 4
        megatron_lm_config:
          megatron_lm_gradient_clipping: 1.0
          megatron_lm_num_micro_batches: 2
          megatron_lm_pp_degree: 2
          megatron_lm_recompute_activations: true
          megatron_lm_sequence_parallelism: true
          megatron_lm_tp_degree: 2
          megatron_lm_use_distributed_optimizer: true
        """))
    assert launch.env_from_accelerate_config(str(config)) == {
        "ACCELERATE_USE_MEGATRON_LM": "true", "ACCELERATE_MIXED_PRECISION": "bf16",
        "MEGATRON_LM_GRADIENT_CLIPPING": "1.0", "MEGATRON_LM_NUM_MICRO_BATCHES": "2", "MEGATRON_LM_PP_DEGREE": "2",
        "MEGATRON_LM_RECOMPUTE_ACTIVATIONS": "True", "MEGATRON_LM_SEQUENCE_PARALLELISM": "True",
        "MEGATRON_LM_TP_DEGREE": "2", "MEGATRON_LM_USE_DISTRIBUTED_OPTIMIZER": "True"}


@pytest.mark.parametrize("text, message", [
    ("distributed_type: MULTI_GPU\n", "has no megatron_lm_config section"),
    ("megatron_lm_config: {tp_degree: 2}\n", "unknown megatron_lm_config key 'tp_degree'"),
    ("a: [1\n", "not YAML"),
])
def test_a_bad_accelerate_config_is_one_line(tmp_path, text, message):
    config = tmp_path / "c.yaml"
    config.write_text(text)
    script = tmp_path / "s.py"
    script.write_text("raise SystemExit('must not run')\n")
    proc = _run(["--config_file", str(config), str(script)])
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_missing_script_is_one_line():
    proc = _run(["no_such_script.py"])
    assert proc.returncode == 1 and proc.stderr.strip() == (
        "megatron.training.accelerate_launch: error: no_such_script.py: no such script")


def test_the_script_sees_megatron_lm_on_cpu_and_its_own_argv(tmp_path):
    """Under the launcher, Accelerate's own modules answer for a CPU: Megatron-LM is available,
    AcceleratorState picks DistributedType.MEGATRON_LM without a GPU, and megatron_lm.py's
    torch.cuda places on the CPU; torch itself is untouched; the script gets its own argv."""
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent("""\
        import sys
        import torch
        import accelerate.utils.megatron_lm as mlm
        from accelerate import Accelerator
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType, is_megatron_lm_available

        assert is_megatron_lm_available()
        accelerator = Accelerator()
        assert accelerator.distributed_type == DistributedType.MEGATRON_LM, accelerator.distributed_type
        assert accelerator.state.megatron_lm_plugin is not None
        assert PartialState().is_main_process == PartialState().is_last_process
        assert mlm.torch.cuda.current_device() == torch.device("cpu")
        assert mlm.torch.cuda.FloatTensor([1.0]).device.type == "cpu"
        assert mlm.torch.nn is torch.nn and torch.cuda.is_available() is False
        assert hasattr(mlm.MegatronEngine, "megatron_generate")
        from accelerate.utils.dataclasses import MODEL_CONFIGS_TO_MEGATRON_PARSERS
        assert all(getattr(p, "_megatron_eos", False) for p in MODEL_CONFIGS_TO_MEGATRON_PARSERS.values())
        print("ARGV", sys.argv[1:])
        """))
    proc = _run([str(script), "--lr", "1e-3"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ARGV ['--lr', '1e-3']" in proc.stdout


def test_without_the_cpu_answers_only_accelerates_gpu_path_is_fixed(tmp_path):
    """enable(cpu=False), what a GPU machine gets: Megatron-LM is available, the parsers pass
    eos_token_id and MegatronEngine has megatron_generate, but the state and torch.cuda are
    Accelerate's own (so on this CPU Accelerate does not pick MEGATRON_LM)."""
    script = tmp_path / "gpu_path.py"
    script.write_text(textwrap.dedent("""\
        import os
        os.environ["ACCELERATE_USE_MEGATRON_LM"] = "true"
        import torch
        from megatron.training import accelerate_launch
        accelerate_launch.enable(cpu=False)
        import accelerate.utils.megatron_lm as mlm
        from accelerate import Accelerator
        from accelerate.utils import DistributedType, is_megatron_lm_available
        from accelerate.utils.dataclasses import MODEL_CONFIGS_TO_MEGATRON_PARSERS

        assert is_megatron_lm_available()
        assert hasattr(mlm.MegatronEngine, "megatron_generate")
        assert all(getattr(p, "_megatron_eos", False) for p in MODEL_CONFIGS_TO_MEGATRON_PARSERS.values())
        assert mlm.torch is torch
        assert Accelerator().distributed_type != DistributedType.MEGATRON_LM
        print("OK")
        """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_enable_after_accelerate_was_imported_is_one_line(tmp_path):
    script = tmp_path / "late.py"
    script.write_text("import accelerate.utils\nfrom megatron.training import accelerate_launch\n"
                      "try:\n    accelerate_launch.enable()\nexcept accelerate_launch.AccelerateLaunchError as e:\n"
                      "    print('REFUSED', e)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert "REFUSED accelerate was imported before megatron.training.accelerate_launch.enable(): call it first" \
        in proc.stdout, proc.stderr[-2000:]
