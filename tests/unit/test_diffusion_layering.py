"""The scheduling side of the diffusion plugin must not import torch (only the runner layer does)."""

import subprocess
import sys


def test_scheduler_loop_and_engine_import_without_torch():
    code = ("import sys; import diffusion_plugin.batcher.scheduler, diffusion_plugin.batcher.loop, diffusion_plugin.api.params, "
            "diffusion_plugin.api.intake, diffusion_plugin.api.chunks, diffusion_plugin.engine_args, "
            "diffusion_plugin.engine; assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_gateway_reads_the_diffusion_schemas_without_torch():
    """The OpenAPI document embeds the knobs' schema and loading a config checks diffusion
    engine_args: neither may pull torch into the gateway's process."""
    code = ("import sys; import gateway.http.openapi; from gateway.config import load_config; "
            "assert any(m.kind.value == 'diffusion' for m in load_config().models); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
