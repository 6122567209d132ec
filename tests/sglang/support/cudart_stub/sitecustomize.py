"""CPU TEST SHIM: with MEGATRON_RL_TEST_STUB_CUDART=1, a no-op `torch.cuda.cudart()` (tests/sglang/support/README.md).

SGLang's `--enable-return-routed-experts` pins its host buffer with `cudaHostRegister`, which has no CPU meaning.
"""

import os

if os.environ.get("MEGATRON_RL_TEST_STUB_CUDART") == "1":
    import torch

    class _NoCudart:
        def cudaHostRegister(self, *args):
            return 0

        def cudaHostUnregister(self, *args):
            return 0

        def cudaGetErrorString(self, rc):
            return "ok (test stub)"

    torch.cuda.cudart = lambda: _NoCudart()
