"""The system-call filter every run gets: bubblewrap's `--seccomp FD` takes it as a classic-BPF program.

It closes the ways to hold memory that no process maps, which the run-wide memory guard (usage.py,
which sums what the run's processes map) cannot see and no rlimit bounds:
- SysV shared memory: a segment made by shmget outlives every attach (shmat, touch, shmdt, repeat:
  640 MiB held under a 64 MiB limit). Refusing shmget is enough: the run's IPC namespace is new, so
  no segment exists that a program could attach without making it;
- memfd_create and memfd_secret: a file in memory, filled by write() without ever being mapped.
POSIX shared memory (shm_open, multiprocessing's semaphores and heap) is a file on /dev/shm, a tmpfs
of a fixed size, and stays allowed. These calls fail with EPERM, as a program sees from any policy.

Only the host's native system-call ABI is let through: a call of another (x86_64's 32-bit
`int 0x80`, where the ipc() multiplexer reaches SysV shm by another number; x32 numbers, which have
bit 0x40000000 set; an arm64 host's 32-bit compat mode) kills the process, so no number is filtered
under one ABI and reached under another.

The program, for seccomp_data {int nr; u32 arch; ...}:
    ld  [4]                        arch
    jeq #AUDIT_ARCH, 0, kill       a foreign ABI
    ld  [0]                        nr
    jge #X32_SYSCALL_BIT, kill, 0  (x86_64 only)
    jeq #shmget, refuse, 0         (and each refused call)
    ret #ALLOW
  refuse: ret #ERRNO|EPERM
  kill:   ret #KILL_PROCESS
"""

from __future__ import annotations

import errno
import struct
from dataclasses import dataclass

from services.code_executor.sandbox import SandboxUnavailable

# linux/bpf_common.h: BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_JMP|BPF_JGE|BPF_K, BPF_RET|BPF_K
LD_W_ABS, JEQ_K, JGE_K, RET_K = 0x20, 0x15, 0x35, 0x06
# linux/seccomp.h: offsets in struct seccomp_data, and the actions
NR_OFFSET, ARCH_OFFSET = 0, 4
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
# linux/audit.h: EM_* | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE, with EM_X86_64 = 62, EM_AARCH64 = 183
AUDIT_ARCH_X86_64, AUDIT_ARCH_AARCH64 = 0xC000003E, 0xC00000B7
X32_SYSCALL_BIT = 0x40000000  # arch/x86/include/uapi/asm/unistd.h
SOCK_FILTER = struct.Struct("=HBBI")  # struct sock_filter {u16 code; u8 jt; u8 jf; u32 k}, native order


@dataclass(frozen=True)
class Abi:
    """One host's native system-call ABI: its AUDIT_ARCH and the numbers of the refused calls."""

    audit_arch: int
    shmget: int
    memfd_create: int
    memfd_secret: int
    x32_bit: bool  # numbers with X32_SYSCALL_BIT set are another ABI under the same AUDIT_ARCH

    def refused(self) -> tuple[int, ...]:
        return (self.shmget, self.memfd_create, self.memfd_secret)


# By os.uname().machine. Numbers from the kernel's tables: x86_64 arch/x86/entry/syscalls/syscall_64.tbl
# (asm/unistd_64.h); aarch64 the generic include/uapi/asm-generic/unistd.h.
ABIS = {
    "x86_64": Abi(AUDIT_ARCH_X86_64, shmget=29, memfd_create=319, memfd_secret=447, x32_bit=True),
    "aarch64": Abi(AUDIT_ARCH_AARCH64, shmget=194, memfd_create=279, memfd_secret=447, x32_bit=False),
}


def syscall_filter(machine: str) -> bytes:
    """The compiled filter for a host of this machine type (os.uname().machine), as bubblewrap reads
    it; SandboxUnavailable for a machine type it is not written for."""
    abi = ABIS.get(machine)
    if abi is None:
        raise SandboxUnavailable(
            f"no seccomp filter is written for this machine type ({machine}; there are for "
            f"{', '.join(ABIS)}), and runs without one could hold memory past their limit"
        )
    # (code, jump if true, jump if false, k); a jump is a label, resolved below, or 0 (the next one)
    program: list[tuple[int, int | str, int | str, int]] = [
        (LD_W_ABS, 0, 0, ARCH_OFFSET),
        (JEQ_K, 0, "kill", abi.audit_arch),
        (LD_W_ABS, 0, 0, NR_OFFSET),
    ]
    if abi.x32_bit:
        program.append((JGE_K, "kill", 0, X32_SYSCALL_BIT))
    program += [(JEQ_K, "refuse", 0, number) for number in abi.refused()]
    program.append((RET_K, 0, 0, RET_ALLOW))
    labels = {"refuse": len(program), "kill": len(program) + 1}
    program += [(RET_K, 0, 0, RET_ERRNO | errno.EPERM), (RET_K, 0, 0, RET_KILL_PROCESS)]

    def offset(at: int, jump: int | str) -> int:
        return jump if isinstance(jump, int) else labels[jump] - at - 1

    return b"".join(
        SOCK_FILTER.pack(code, offset(at, true), offset(at, false), k)
        for at, (code, true, false, k) in enumerate(program)
    )
