"""A replica's weights loop when a collective's group breaks under it (its publisher, the trainer,
was killed and restarted: gloo raises RuntimeError "Connection closed by peer"): the version is
reported failed, pulled by gRPC, and the subscriber asks to join the next epoch; nothing escapes
to end the loop (which used to stop the replica)."""

import asyncio

from shared.rpc.steadyrl.v1 import common_pb2
from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
from shared.weightsync.subscriber import WatchSubscriber


class BrokenGroup:
    transport = "collective"
    version = 7

    def buckets(self):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.89.0.73]:60826")

    def close(self):
        pass


def test_a_broken_group_is_reported_and_the_version_pulled_by_grpc():
    async def main():
        async def apply(delivery):
            list(delivery.buckets())
            return 0.0

        subscriber = WatchSubscriber("127.0.0.1:1", apply)
        reports, pulls = [], []
        subscriber.deliveries = lambda announcement: BrokenGroup()

        async def report(stub, announcement, error):
            reports.append((announcement.version.version, error))

        async def pull_when_held(version, patience):
            pulls.append(version)
            return True

        subscriber._report = report
        subscriber._pull_when_held = pull_when_held
        announcement = pb.VersionAnnouncement(
            version=common_pb2.PolicyVersion(version=7),
            transport=pb.Transport(kind=pb.COLLECTIVE, epoch=1, timeout_seconds=5),
        )
        rejoin = await subscriber._receive(None, announcement)
        return rejoin, reports, pulls

    rejoin, reports, pulls = asyncio.run(main())
    assert rejoin is True  # subscribe again: the next epoch is formed without the broken group
    assert reports == [(7, "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.89.0.73]:60826")]
    assert pulls == [7]
