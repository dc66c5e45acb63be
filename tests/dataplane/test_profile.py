"""`kvstore.bench.dataplane_profile`: perf's samples sorted into where the CPU went, per GB."""

from kvstore.bench import dataplane_profile as profile

REPORT = """\
# Samples: 71K of event 'cpu-clock:ppp'
#
#      Samples  Shared Object          Symbol
# ............  .....................  ......
#
           722  [kernel.kallsyms]      [k] _copy_from_iter
           205  [kernel.kallsyms]      [k] _copy_to_iter
            30  [kernel.kallsyms]      [k] ____sys_sendmsg
           410  libpython3.11.so.1.0   [.] _PyEval_EvalFrameDefault
            12  _asyncio.cpython-311-x86_64-linux-gnu.so  [.] task_step_impl
           349  libc.so.6              [.] __memmove_avx512_unaligned_erms
             7  libc.so.6              [.] __libc_recv
            70  libucp.so.0.0.0        [.] ucp_tag_recv_nbx
            25  libucxx.so             [.] ucxx::Request::callback
            40  _crc32c.cpython-311-x86_64-linux-gnu.so  [.] crc32c_hw
             3  [vdso]                 [.] __vdso_gettimeofday
"""


def test_samples_fall_into_the_first_category_that_matches() -> None:
    counts = profile.categorize(REPORT)
    assert counts == {
        "kernel copy": 927,
        "kernel other": 30,
        "crc32c": 40,  # before "python": the extension module is CRC32C's
        "ucx": 95,
        "memcpy": 349,
        "python": 422,
        "other": 10,  # libc's recv, the vDSO
    }


def test_a_row_is_cpu_per_gb_moved_by_category() -> None:
    samples = {"kernel copy": 999, "python": 1998, "other": 0}
    row = profile.row_of("ucxx-raw-tcp", 256 << 10, samples, moved=2 * 10**9, window_s=2.0)
    assert row["gbps"] == 1.0
    assert row["cores_busy"] == 1.5  # 3 CPU-seconds over a 2-second window
    assert row["cpu_s_per_gb"] == 1.5
    assert (row["kernel_copy"], row["python"], row["other"]) == (0.5, 1.0, 0.0)


def test_nothing_moved_leaves_the_per_gb_columns_empty() -> None:
    row = profile.row_of("tcp-socket", 1 << 20, {"python": 5}, moved=0, window_s=1.0)
    assert row["cpu_s_per_gb"] is None and row["python"] is None


DEV = """\
Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs
  eth0: 9876543   1234    0    0    0     0          0         0  1111111     999    0
    lo: 123456789  4321    0    0    0     0          0         0 123456789   4321    0
"""


def test_the_window_counts_what_loopback_received() -> None:
    assert profile._loopback_bytes(DEV) == 123456789
