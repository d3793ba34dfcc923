"""The code-executor's seccomp filter as a program: run through a classic-BPF interpreter written here, for
both machine types it is written for (the sandbox tests in test_code_executor.py run it for real, on
this host's only). The numbers in the tables below are the kernel's, written out again on purpose."""

from __future__ import annotations

import errno
import struct

import pytest

from services.code_executor.sandbox import SandboxUnavailable
from services.code_executor.seccomp import syscall_filter

ALLOW, REFUSE, KILL = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x80000000
AUDIT_ARCH = {"x86_64": 0xC000003E, "i386": 0x40000003, "aarch64": 0xC00000B7, "arm": 0x40000028}


def verdict(program: bytes, arch: int, nr: int) -> int:
    """Run a classic-BPF program (the four instructions the filter uses) on seccomp_data {nr, arch}."""
    data = struct.pack("=iI", nr, arch)
    filters = [struct.unpack_from("=HBBI", program, at) for at in range(0, len(program), 8)]
    pc, accumulator = 0, 0
    while True:
        code, jt, jf, k = filters[pc]
        if code == 0x20:  # ld [k]
            (accumulator,) = struct.unpack_from("=I", data, k)
            pc += 1
        elif code in (0x15, 0x35):  # jeq #k, jge #k
            taken = accumulator == k if code == 0x15 else accumulator >= k
            pc += 1 + (jt if taken else jf)
        elif code == 0x06:  # ret #k
            return k
        else:
            raise AssertionError(f"instruction {code:#x} at {pc}")


@pytest.mark.parametrize(
    "machine, arch, nr, expected",
    [
        # x86_64 (syscall_64.tbl): shmget 29, memfd_create 319, memfd_secret 447 refused
        ("x86_64", "x86_64", 29, REFUSE),
        ("x86_64", "x86_64", 319, REFUSE),
        ("x86_64", "x86_64", 447, REFUSE),
        ("x86_64", "x86_64", 0, ALLOW),  # read
        ("x86_64", "x86_64", 30, ALLOW),  # shmat: nothing to attach that shmget did not make
        ("x86_64", "x86_64", 57, ALLOW),  # fork
        ("x86_64", "x86_64", 0x40000000 + 29, KILL),  # x32's shmget
        ("x86_64", "x86_64", 0x40000000, KILL),  # x32's read
        ("x86_64", "i386", 117, KILL),  # int 0x80: ipc(), which reaches SysV shm by another number
        ("x86_64", "i386", 3, KILL),  # int 0x80: read
        ("x86_64", "aarch64", 0, KILL),
        # aarch64 (asm-generic/unistd.h): shmget 194, memfd_create 279, memfd_secret 447 refused
        ("aarch64", "aarch64", 194, REFUSE),
        ("aarch64", "aarch64", 279, REFUSE),
        ("aarch64", "aarch64", 447, REFUSE),
        ("aarch64", "aarch64", 29, ALLOW),  # ioctl here, shmget on x86_64: the tables are not mixed up
        ("aarch64", "aarch64", 63, ALLOW),  # read
        ("aarch64", "aarch64", 0x40000000 + 29, ALLOW),  # no x32 here: an unknown number, ENOSYS
        ("aarch64", "arm", 307, KILL),  # 32-bit compat shmget
        ("aarch64", "x86_64", 29, KILL),
    ],
)
def test_the_filter_refuses_memory_no_process_maps_and_kills_foreign_abis(machine, arch, nr, expected):
    assert verdict(syscall_filter(machine), AUDIT_ARCH[arch], nr) == expected


def test_the_filter_is_whole_sock_filter_records():
    # bubblewrap refuses a program that is not a multiple of 8 bytes; x86_64: ld, jeq arch, ld, jge x32,
    # three jeq, allow, refuse, kill = 10 records
    assert len(syscall_filter("x86_64")) == 10 * 8 and len(syscall_filter("aarch64")) == 9 * 8


def test_a_machine_without_a_filter_is_refused():
    with pytest.raises(SandboxUnavailable, match="riscv64"):
        syscall_filter("riscv64")
