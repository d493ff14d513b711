"""The scheduling side of the diffusion plugin must not import torch (only the runner layer does)."""

import subprocess
import sys


def test_scheduler_loop_and_engine_import_without_torch():
    code = ("import sys; import diffusion_plugin.scheduler, diffusion_plugin.loop, diffusion_plugin.params, "
            "diffusion_plugin.engine; assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
