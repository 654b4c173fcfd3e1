"""``tests.kernels.utils``: vLLM's ``opcheck`` (torch.library.opcheck with vLLM's default
checks, skipped when ``cond`` is false)."""

import torch

from peer_shim_support import module_getattr

DEFAULT_OPCHECK_TEST_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor")
ALL_OPCHECK_TEST_UTILS = DEFAULT_OPCHECK_TEST_UTILS + ("test_aot_dispatch_dynamic",)


def opcheck(op, args, kwargs=None, *, test_utils=DEFAULT_OPCHECK_TEST_UTILS,
            raise_exception=True, cond=True):
    if not cond:
        return {}
    return torch.library.opcheck(op, args, kwargs, test_utils=test_utils,
                                 raise_exception=raise_exception)


__getattr__ = module_getattr("tests.kernels.utils")
