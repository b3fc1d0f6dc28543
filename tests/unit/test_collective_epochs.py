"""Collective membership epochs (`services.weightsync.members.Membership`): a new epoch when the
members change, when one failed, or when the publisher holds no group of the current one (a
trainer restarted after a crash: sent into its predecessor's group it waited out the timeout)."""

from services.weightsync.members import COLLECTIVE, GRPC, Membership, Subscriber


def test_an_epoch_lasts_while_members_and_publisher_stay():
    members = Membership()
    members.add(Subscriber("a", {GRPC, COLLECTIVE}, "h1"))
    members.add(Subscriber("b", {GRPC, COLLECTIVE}, "h2"))
    first = members.epoch_for_announce(0)  # the publisher's first push: it holds no group
    assert (first.number, first.members) == (1, ("a", "b"))
    assert members.epoch_for_announce(1).number == 1  # it leads epoch 1 now: the same group
    members.add(Subscriber("c", {GRPC}, "h3"))  # gRPC only: no member
    assert members.epoch_for_announce(1).number == 1
    members.add(Subscriber("d", {GRPC, COLLECTIVE}, "h4"))
    assert members.epoch_for_announce(1).number == 2  # a member more


def test_a_restarted_publisher_gets_a_new_epoch():
    members = Membership()
    members.add(Subscriber("a", {GRPC, COLLECTIVE}, "h1"))
    assert members.epoch_for_announce(0).number == 1
    assert members.epoch_for_announce(1).number == 1
    # the trainer crashed and came back: its first push holds no group
    assert members.epoch_for_announce(0).number == 2
    assert members.epoch_for_announce(2).number == 2
