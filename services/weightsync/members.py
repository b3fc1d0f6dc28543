"""Who receives each version, and how: the subscribers of the Watch streams, and the members of the current
collective epoch.

A subscriber says which transports it can receive (gRPC always) and on which host it runs. Its id is its own while its
stream is open: another stream naming it is refused (`SubscriberTaken`), but a member that closes its stream and
subscribes again at once gets it back. A closed member stream or a failed transfer ends the epoch; members that did
not confirm the failed version receive by gRPC until they subscribe again, so a dead or frozen replica is never waited
for twice.

Details: docs/internals/weights.md"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass, field

from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb

GRPC = pb.GRPC
SHM = pb.SHM
COLLECTIVE = pb.COLLECTIVE
RELEASE_SECONDS = 2.0  # how long a new stream waits for the id's previous stream to end (a member subscribing again)


class SubscriberTaken(ValueError):
    """A subscriber id held by another open Watch stream."""


@dataclass(eq=False)
class Subscriber:
    id: str
    transports: set[int]
    host: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    order: int = 0
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # set when its stream ends


@dataclass
class Epoch:
    number: int = 0
    members: tuple[str, ...] = ()
    ended: bool = True
    confirmed: dict[int, set[str]] = field(default_factory=dict)  # version → members that received it


class Membership:
    def __init__(self) -> None:
        self.subscribers: dict[str, Subscriber] = {}
        self.epoch = Epoch()
        self._order = itertools.count()

    def add(self, subscriber: Subscriber) -> Subscriber:
        """`subscriber` takes its id (SubscriberTaken: another open stream holds it)."""
        previous = self.subscribers.get(subscriber.id)
        if previous is not None:
            raise SubscriberTaken(
                f"subscriber id {subscriber.id!r} is held by another open Watch stream (host {previous.host!r}): "
                "give each replica its own id"
            )
        subscriber.order = next(self._order)
        self.subscribers[subscriber.id] = subscriber
        return subscriber

    async def join(self, subscriber: Subscriber, release: float = RELEASE_SECONDS) -> Subscriber:
        """`add`, once the stream that holds the id (if one does) ended, waiting `release` seconds
        at most: a member that subscribes again closed its old stream just before."""
        previous = self.subscribers.get(subscriber.id)
        if previous is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(previous.gone.wait(), release)
        return self.add(subscriber)

    def remove(self, subscriber: Subscriber) -> None:
        subscriber.gone.set()
        if self.subscribers.get(subscriber.id) is subscriber:
            del self.subscribers[subscriber.id]
            if subscriber.id in self.epoch.members:
                self.epoch.ended = True

    def wanting(self) -> tuple[str, ...]:
        """Subscribers that receive collectives, in the order they joined."""
        live = [s for s in self.subscribers.values() if COLLECTIVE in s.transports]
        return tuple(s.id for s in sorted(live, key=lambda s: s.order))

    def epoch_for_announce(self, publisher_epoch: int = 0) -> Epoch:
        """The epoch the next collective uses: a new one when membership changed, one failed, or the
        publisher holds no group of this epoch (`publisher_epoch`: the epoch of its group, 0 for none:
        a trainer restarted after a crash must not be sent into the group its predecessor led)."""
        members = self.wanting()
        if self.epoch.ended or members != self.epoch.members or publisher_epoch != self.epoch.number:
            self.epoch = Epoch(self.epoch.number + 1, members, False)
        return self.epoch

    def confirm(self, epoch: int, version: int, subscriber_id: str) -> None:
        if epoch == self.epoch.number:
            self.epoch.confirmed.setdefault(version, set()).add(subscriber_id)

    def fail(self, epoch: int, version: int) -> list[str]:
        """A transfer of `version` on `epoch` failed: end the epoch; members that did not confirm
        the version leave the collective. Returns who left."""
        if epoch != self.epoch.number or self.epoch.ended:
            return []
        self.epoch.ended = True
        confirmed = self.epoch.confirmed.get(version, set())
        gone = [m for m in self.epoch.members if m not in confirmed]
        for member in gone:
            subscriber = self.subscribers.get(member)
            if subscriber is not None:
                subscriber.transports.discard(COLLECTIVE)
        return gone
