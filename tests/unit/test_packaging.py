"""Our generic top-level package names must not confuse our dependencies."""

import subprocess
import sys


def test_transformers_does_not_take_our_kernels_package_for_the_hub_one():
    from transformers.utils import import_utils

    assert not import_utils.is_kernels_available()


def test_gateway_and_schedulers_do_not_import_torch():
    code = (
        "import sys; import tandem.gateway.app, tandem.decode.scheduler, tandem.prefill.scheduler, tandem.engine.block_allocator, tandem.cli;"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_help_lists_every_service():
    out = subprocess.run([sys.executable, "-m", "tandem", "--help"], capture_output=True, text=True, check=True)
    for command in ("serve", "gateway", "prefill", "decode", "bench"):
        assert command in out.stdout
