"""torch's thread count reaches the thread that runs the model, not only the one that set it."""

import concurrent.futures
import os

import pytest
import torch

from shared.runtime.torch_threads import bind_torch_threads

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: torch's default is one thread anyway")


def threads_started_by(fn) -> int:
    """OS threads that appear while `fn` runs on a fresh executor thread (OpenMP starts its team
    of intra-op threads lazily, per calling thread)."""

    def run() -> int:
        before = set(os.listdir("/proc/self/task"))
        fn()
        return len(set(os.listdir("/proc/self/task")) - before)  # new ids: a thread ending meanwhile does not count

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()


def matmul() -> None:
    a = torch.randn(800, 800)
    torch.softmax(a @ a, -1)


def test_set_elsewhere_does_not_reach_a_worker_thread_but_bind_does():
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(torch.set_num_threads, 1).result()
    assert threads_started_by(matmul) >= 1  # set in another thread: torch's default team here
    assert threads_started_by(lambda: (bind_torch_threads(1), matmul())) == 0


def test_the_loops_default_executor_binds_every_thread_it_starts():
    """`asyncio.to_thread` work (a version copied into the engine, a version cast to publish) runs
    with the service's count: bound, an executor thread starts no OpenMP team."""
    import asyncio

    from shared.runtime.torch_threads import bind_default_executor

    def count_and_team() -> tuple[int, int]:
        before = set(os.listdir("/proc/self/task"))
        matmul()
        return torch.get_num_threads(), len(set(os.listdir("/proc/self/task")) - before)

    async def main(threads: int) -> tuple[int, int]:
        bind_default_executor(threads)
        bind_default_executor(threads)  # a second service in the same loop keeps the executor
        return await asyncio.to_thread(count_and_team)

    assert asyncio.run(main(2))[0] == 2  # whatever a new thread would inherit, each count reaches it
    assert asyncio.run(main(1)) == (1, 0)  # and one thread starts no team
