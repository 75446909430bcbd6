"""The sans-IO SWIM protocol, driven through a simulated cluster.

Many ``Swim`` objects in one process (``p2pxfer.membership.sim``), with a fake
network (random delays, drops, partitions) and fake time, so every scenario
is deterministic for its seed and runs in milliseconds of simulated periods.
Bounds are stated in protocol periods (``period = 1.0`` here).
"""

from __future__ import annotations

import math

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pxfer import membership
from p2pxfer.membership import (
    AuthFailed,
    BadDatagram,
    ClusterAuth,
    Member,
    MemberAlive,
    MemberDead,
    MemberJoined,
    MemberLeft,
    MemberRestarted,
    MemberState,
    MemberSuspect,
    Superseded,
    Swim,
    SwimConfig,
)
from p2pxfer.membership._wire import KINDS, WireError, decode, encode
from p2pxfer.membership.sim import SimCluster

ALIVE, SUSPECT, DEAD, LEFT = (MemberState.ALIVE, MemberState.SUSPECT, MemberState.DEAD,
                              MemberState.LEFT)
TOKEN = b"cluster-token"


def about(events: list[object], name: str, kind: type) -> list[object]:
    return [e for e in events if isinstance(e, kind)
            and e.member.name == name]  # type: ignore[attr-defined]


def formed(n: int, *, seed: int = 1, drop: float = 0.0,
           config: SwimConfig | None = None) -> SimCluster:
    """A converged cluster of ``n`` members (joined through m000 over 2 periods)."""
    c = SimCluster(config, seed=seed, drop=drop, delay=(0.001, 0.02))
    c.bootstrap(n, stagger=2.0)
    assert c.run_until(c.converged, 60) is not None, "the cluster never formed"
    return c


# -- join ---------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "drop", "bound"), [(32, 0.0, 10), (64, 0.02, 15),
                                                  (128, 0.0, 20)])
def test_join_convergence(n: int, drop: float, bound: float) -> None:
    """``n`` members join through one seed within 2 periods: every member sees
    every other alive, at its incarnation, within ``bound`` periods."""
    c = SimCluster(seed=n, drop=drop, delay=(0.001, 0.02))
    c.bootstrap(n, stagger=2.0)
    took = c.run_until(c.converged, 60)
    assert took is not None and took <= bound, took
    seed_events = c.events["m000"]
    assert {e.member.name for e in seed_events if isinstance(e, MemberJoined)} \
        == set(c.nodes) - {"m000"}
    assert all(node.joined for node in c.nodes.values())


def test_256_members_one_join_and_one_death() -> None:
    """At 256 members: a mass join converges, then one more join reaches
    everyone in O(log n) periods and one death is known everywhere within
    the suspicion timeout plus a few periods."""
    c = SimCluster(seed=4, delay=(0.001, 0.02))
    c.bootstrap(256, stagger=2.0)
    formed_in = c.run_until(c.converged, 60, check_every=1.0)
    assert formed_in is not None and formed_in <= 30, formed_in
    late = c.start("late", "10.9.0.1:7946", [c.address_of(17)])
    took = c.run_until(lambda: c.all_see("late", [ALIVE], late.me.incarnation), 30)
    assert took is not None and took <= 2 * math.log2(256), took
    assert late.joined and len(c.view("late")) == 256
    timeout = c.nodes["m000"].suspicion_timeout()
    c.kill("m100")
    took = c.run_until(lambda: c.all_see("m100", [DEAD]), 40)
    assert took is not None and took <= timeout + 8, (took, timeout)


def test_join_retries_until_a_seed_answers() -> None:
    c = SimCluster(seed=3)
    first = c.start("a", "10.0.0.1:7946", ["10.0.0.2:7946"])  # its seed is not up yet
    c.run_for(3)
    assert not first.joined
    c.start("b", "10.0.0.2:7946")
    assert c.run_until(lambda: first.joined and c.converged(), 5) is not None


# -- leave and death ----------------------------------------------------------------


def test_graceful_leave_propagates() -> None:
    c = formed(32, seed=5)
    inc = c.nodes["m007"].me.incarnation
    c.leave("m007")
    took = c.run_until(lambda: c.all_see("m007", [LEFT]), 10)
    assert took is not None and took <= 4, took
    for name, node in c.nodes.items():
        assert about(c.events[name], "m007", MemberLeft), name
        assert not about(c.events[name], "m007", MemberDead), name
        assert not node.is_current("m007", inc)
    assert c.converged()


@pytest.mark.parametrize(("n", "drop"), [(64, 0.0), (64, 0.03)])
def test_killed_member_is_declared_dead_in_bounded_time(n: int, drop: float) -> None:
    c = formed(n, seed=6, drop=drop)
    timeout = c.nodes["m000"].suspicion_timeout()
    inc = c.nodes["m042"].me.incarnation
    c.kill("m042")
    first = c.run_until(lambda: any(about(ev, "m042", MemberSuspect)
                                    for ev in c.events.values()), 10)
    everyone = c.run_until(lambda: c.all_see("m042", [DEAD]), 30)
    assert first is not None and first <= 4, first
    assert everyone is not None and first + everyone <= timeout + 6, (first, everyone, timeout)
    for name, node in c.nodes.items():
        assert not node.is_current("m042", inc)
        assert len(about(c.events[name], "m042", MemberDead)) == 1
    # Without false positives among the living (no loss) or with them refuted.
    assert c.run_until(c.converged, 20) is not None


# -- incarnations -------------------------------------------------------------------


def test_restart_before_detection_is_a_new_member_and_voids_the_old_life() -> None:
    c = formed(32, seed=7)
    old = c.kill("m010").me.incarnation
    c.run_for(0.3)  # back before anyone declared it dead
    new = c.start("m010", c.address_of(10), [c.address_of(0)], incarnation=old + 10**9)
    took = c.run_until(lambda: c.all_see("m010", [ALIVE], new.me.incarnation), 20)
    assert took is not None, "the new life never got through"
    for name, node in c.nodes.items():
        if name == "m010":
            continue
        assert not node.is_current("m010", old), name
        assert node.is_current("m010", new.me.incarnation), name
        restarted = about(c.events[name], "m010", MemberRestarted)
        rejoined = [e for e in about(c.events[name], "m010", MemberJoined)
                    if e.member.incarnation == new.me.incarnation]  # type: ignore[attr-defined]
        assert restarted or rejoined, name
        for e in restarted:
            assert e.previous_incarnation == old  # type: ignore[attr-defined]
    assert any(about(c.events[n], "m010", MemberRestarted) for n in c.nodes)


def test_restart_after_death_joins_again_and_stale_gossip_is_refused() -> None:
    c = formed(16, seed=8)
    gone = c.kill("m003")
    old = gone.me.incarnation
    assert c.run_until(lambda: c.all_see("m003", [DEAD]), 30) is not None
    new = c.start("m003", c.address_of(3), [c.address_of(1)], incarnation=old + 1)
    assert c.run_until(lambda: c.all_see("m003", [ALIVE], old + 1), 20) is not None
    # A straggling report of the old life, alive, changes nothing.
    stale = ("m003", c.address_of(3), old, 5, ALIVE, ())
    node = c.nodes["m001"]
    auth = ClusterAuth(TOKEN)
    sender = c.nodes["m002"].me
    body = encode("swim_leave", (sender.name, sender.address, sender.incarnation,
                                 sender.version, ALIVE, ()), u=[stale])
    node.receive(auth.seal(body), sender.address, c.now)
    assert node.member("m003").incarnation == new.me.incarnation  # type: ignore[union-attr]
    assert not node.is_current("m003", old) and node.is_current("m003", old + 1)
    assert not [e for e in node.take_events() if isinstance(e, MemberRestarted)]


def test_superseded_when_a_newer_life_of_our_name_appears() -> None:
    stale = Swim(Member("a", "10.0.0.1:1", 100), TOKEN)
    newer = ("a", "10.0.0.3:1", 200, 0, ALIVE, ())
    body = encode("swim_ping", ("b", "10.0.0.2:1", 1, 0, ALIVE, ()), seq=1, to="a", d=0,
                  u=[newer])
    stale.receive(ClusterAuth(TOKEN).seal(body), "10.0.0.2:1", 0.0)
    [superseded] = [e for e in stale.take_events() if isinstance(e, Superseded)]
    assert superseded.member.incarnation == 200
    assert stale.me == Member("a", "10.0.0.1:1", 100)  # it neither refutes nor adopts it


# -- suspicion ----------------------------------------------------------------------


def test_suspicion_is_refuted_by_a_live_member() -> None:
    cfg = SwimConfig(period=1.0, ack_timeout=0.4, suspicion_mult=8.0)
    c = formed(16, seed=10, config=cfg)
    others = [n for n in c.nodes if n != "m005"]
    c.partition(["m005"], others)  # m005 misses its probes for a while...
    assert c.run_until(lambda: any(about(c.events[n], "m005", MemberSuspect)
                                   for n in others), 10) is not None
    c.heal()  # ... and is back before anyone's suspicion runs out
    assert c.run_until(c.converged, 20) is not None
    me = c.nodes["m005"].me
    assert me.version >= 1 and me.incarnation == c.nodes["m001"].member("m005").incarnation  # type: ignore[union-attr]
    assert c.nodes["m005"].statistics().refutations >= 1
    for n in others:
        assert not about(c.events[n], "m005", MemberDead), n
        if about(c.events[n], "m005", MemberSuspect):
            assert about(c.events[n], "m005", MemberAlive), n


# -- starved, not dead (host_check, starved_grace) ------------------------------------

CHECKED = SwimConfig(period=1.0, ack_timeout=0.4, host_check=1.0, starved_grace=10.0)


def test_a_starved_member_whose_host_answers_is_not_declared_dead() -> None:
    """Paused (its process not scheduled) for three suspicion timeouts: the
    others suspect it, ask its host, hear it answer, and keep it suspect
    until it runs again and refutes. Without the checks it dies."""
    c = formed(8, seed=21, config=CHECKED)
    timeout = c.nodes["m000"].suspicion_timeout()
    others = [n for n in c.nodes if n != "m003"]
    c.pause("m003")
    assert c.run_until(lambda: any(about(c.events[n], "m003", MemberSuspect)
                                   for n in others), 10) is not None
    c.run_for(3 * timeout)
    assert c.all_see("m003", [SUSPECT]), {n: c.nodes[n].member("m003") for n in others}
    c.resume("m003")
    assert c.run_until(c.converged, 20) is not None
    for n in others:
        assert not about(c.events[n], "m003", MemberDead), n

    # Further apart each time: a starved host's accept queue holds them all.
    assert c.host_checks <= 5 * len(others), c.host_checks

    plain = formed(8, seed=21)
    plain.pause("m003")
    assert plain.run_until(lambda: plain.all_see("m003", [DEAD]), 3 * timeout + 10) \
        is not None


def test_a_starved_member_dies_once_its_grace_is_spent() -> None:
    c = formed(8, seed=22, config=CHECKED)
    timeout = c.nodes["m000"].suspicion_timeout()
    c.pause("m004")
    took = c.run_until(lambda: c.all_see("m004", [DEAD]), 60)
    # Its first suspicion, the grace, then a check or two of slack.
    assert took is not None and 10.0 <= took <= timeout + 10.0 + 6, (took, timeout)


def test_a_killed_member_dies_at_once_when_its_host_refuses() -> None:
    c = formed(8, seed=23, config=CHECKED)
    timeout = c.nodes["m000"].suspicion_timeout()
    c.kill("m005")
    took = c.run_until(lambda: c.all_see("m005", [DEAD]), 30)
    # As without checks (one period to suspect, the suspicion, spread), plus
    # the refusal's round trip: never the grace.
    assert took is not None and took <= timeout + 6, (took, timeout)


def test_a_silent_host_costs_one_check_more() -> None:
    c = formed(8, seed=24, config=CHECKED)
    timeout = c.nodes["m000"].suspicion_timeout()
    others = [n for n in c.nodes if n != "m006"]
    c.partition(["m006"], others)
    took = c.run_until(lambda: c.all_see("m006", [DEAD]), 30)
    assert took is not None and took <= timeout + CHECKED.host_check + 6, (took, timeout)


def test_local_suspicion_speeds_up_a_death_and_is_refuted_by_the_living() -> None:
    c = formed(16, seed=12)
    timeout = c.nodes["m000"].suspicion_timeout()
    # A live member suspected on local evidence clears itself.
    assert c.nodes["m000"].suspect("m003", c.now)
    assert not c.nodes["m000"].suspect("m003", c.now)  # already suspect
    assert not c.nodes["m000"].suspect("nobody", c.now)
    assert c.run_until(c.converged, 20) is not None
    assert not any(about(ev, "m003", MemberDead) for ev in c.events.values())
    # A killed one is dead everywhere about one suspicion timeout later: no
    # waiting for a failed probe first.
    c.kill("m009")
    assert c.nodes["m000"].suspect("m009", c.now)
    everyone = c.run_until(lambda: c.all_see("m009", [DEAD]), 30)
    assert everyone is not None and everyone <= timeout + 2, (everyone, timeout)


def test_a_member_refutes_at_once_when_told_it_is_suspect() -> None:
    a = Swim(Member("a", "10.0.0.1:1", 100), TOKEN, SwimConfig(period=1.0, ack_timeout=0.4))
    b = Swim(Member("b", "10.0.0.2:1", 200), TOKEN, SwimConfig(period=1.0, ack_timeout=0.4))
    auth = ClusterAuth(TOKEN)
    body = encode("swim_ping", ("b", "10.0.0.2:1", 200, 0, ALIVE, ()), seq=9, to="a", d=0,
                  u=[("a", "10.0.0.1:1", 100, 0, SUSPECT, ())])
    out = a.receive(auth.seal(body), "10.0.0.2:1", 0.0)
    assert next(o.kind for o in out) == "swim_ack" and a.me.version == 1
    b.receive(out[0].data, "10.0.0.1:1", 0.0)
    assert b.member("a") == Member("a", "10.0.0.1:1", 100, ALIVE, 0.0, 1)
    assert [type(e) for e in b.take_events()] == [MemberJoined]


# -- partitions ---------------------------------------------------------------------


def test_partition_heals_and_membership_converges() -> None:
    c = formed(32, seed=11)
    names = sorted(c.nodes)
    left, right = names[:16], names[16:]
    c.partition(left, right)
    split = c.run_until(lambda: all(c.nodes[a].member(b).state is DEAD  # type: ignore[union-attr]
                                    for a in left for b in right), 40)
    assert split is not None, "the halves never gave up on each other"
    assert all(c.view(a)[b].state is ALIVE for a in left for b in left if a != b)
    c.heal()
    took = c.run_until(c.converged, 40)
    assert took is not None and took <= 25, took
    # Same lives on both sides: everything came back as MemberAlive, no restarts.
    assert not any(isinstance(e, MemberRestarted) for ev in c.events.values() for e in ev)
    assert all(c.nodes[a].is_current(b, c.nodes[b].me.incarnation)
               for a in names for b in names)


@pytest.mark.parametrize("seed", [21, 22, 23])
def test_a_healed_minority_cannot_kill_members_the_majority_hears(seed: int) -> None:
    """One member cut off long enough to declare the other three dead; the
    link heals and its verdicts reach them. Each has heard from the others
    itself within a suspicion's length: the verdict is a suspicion there,
    refuted, never a death (a write between two of them would fail on it)."""
    c = formed(4, seed=seed)
    names = sorted(c.nodes)
    lone, rest = names[-1], names[:-1]
    c.partition([lone], rest)
    assert c.run_until(lambda: all(c.nodes[lone].member(n).state is DEAD  # type: ignore[union-attr]
                                   for n in rest), 30) is not None
    c.heal()
    assert c.run_until(c.converged, 30) is not None
    for n in rest:
        for m in rest:
            assert not about(c.events[n], m, MemberDead), (n, m)
    # A real death is still taken at once from another member's word: the
    # dead member was last heard from longer ago than a suspicion lasts.
    c.kill(rest[0])
    timeout = c.nodes[rest[1]].suspicion_timeout()
    took = c.run_until(lambda: c.all_see(rest[0], [DEAD]), 30)
    assert took is not None and took <= timeout + 4 * c.nodes[rest[1]].config.period, took


# -- authentication -----------------------------------------------------------------


def test_a_member_without_the_token_cannot_join() -> None:
    c = formed(8, seed=12)
    intruder = c.start("intruder", "10.6.6.6:7946", [c.address_of(0), c.address_of(1)],
                       token=b"guessed")
    c.run_for(6)
    assert not intruder.joined
    assert all(node.member("intruder") is None for n, node in c.nodes.items()
               if n != "intruder")
    fails = [e for e in c.events["m000"] if isinstance(e, AuthFailed)]
    assert fails and fails[0].source == "10.6.6.6:7946" and "MAC" in fails[0].reason
    # Repeats are counted, and reported at 1, 2, 4, 8... failures only.
    assert [e.count for e in fails] == [2 ** i for i in range(len(fails))]
    assert c.nodes["m000"].statistics().auth_failures > len(fails)
    # Nor does the intruder believe anything the cluster says to it.
    assert intruder.members(include_self=False) == []


def test_join_needs_the_challenge_answered() -> None:
    """A token holder that skips the challenge (a replayed or forged second
    step) is refused, and so is a wrong proof."""
    seed = Swim(Member("seed", "10.0.0.1:1", 1), TOKEN)
    seed.join([], 0.0)
    auth = ClusterAuth(TOKEN)
    me = ("j", "10.0.0.2:1", 5, 0, ALIVE, ())
    forged = encode("swim_join", me, nonce=b"n" * 16, challenge=b"c" * 16, proof=b"p" * 32)
    assert seed.receive(auth.seal(forged), "10.0.0.2:1", 0.0) == []
    out = seed.receive(auth.seal(encode("swim_join", me, nonce=b"n" * 16)), "10.0.0.2:1", 0.0)
    assert [o.kind for o in out] == ["swim_challenge"]
    challenge = decode(auth.open(out[0].data))
    assert auth.check(b"n" * 16, "seed", challenge.proof)  # type: ignore[arg-type]
    wrong = encode("swim_join", me, nonce=b"n" * 16, challenge=challenge.challenge,
                   proof=auth.prove(challenge.challenge, "someone-else"))  # type: ignore[arg-type]
    assert seed.receive(auth.seal(wrong), "10.0.0.2:1", 0.0) == []
    assert seed.member("j") is None
    assert next(e.reason for e in seed.take_events() if isinstance(e, AuthFailed)) \
        .startswith("join from 'j'")


def test_tampered_datagrams_are_refused() -> None:
    a = Swim(Member("a", "10.0.0.1:1", 1), TOKEN)
    auth = ClusterAuth(TOKEN)
    good = auth.seal(encode("swim_ping", ("b", "10.0.0.2:1", 2, 0, ALIVE, ()), seq=1, to="a",
                            d=0, u=[]))
    bad = bytearray(good)
    bad[-1] ^= 1
    assert a.receive(bytes(bad), "10.0.0.2:1", 0.0) == []
    assert a.receive(good[:20], "10.0.0.2:1", 0.0) == []
    assert a.member("b") is None
    assert a.receive(good, "10.0.0.2:1", 0.0)[0].kind == "swim_ack"
    assert a.statistics().auth_failures == 2


# -- cost ---------------------------------------------------------------------------


def test_message_rate_per_member_is_constant() -> None:
    """Datagrams per member per period in a steady cluster do not grow with n:
    one ping and one ack, plus indirect probes when datagrams are lost."""
    rates = {}
    for n in (16, 96):
        for drop in (0.0, 0.02):
            c = formed(n, seed=13, drop=drop)
            before = {k: v.statistics().sent for k, v in c.nodes.items()}
            c.run_for(15)
            rates[n, drop] = sum(v.statistics().sent - before[k]
                                 for k, v in c.nodes.items()) / n / 15
    for (_, drop), rate in rates.items():
        assert rate <= (2.05 if drop == 0 else 3.0), rates
    for drop in (0.0, 0.02):
        assert abs(rates[96, drop] - rates[16, drop]) < 0.5, rates


def test_datagrams_stay_under_the_limit_with_many_changes() -> None:
    c = SimCluster(SwimConfig(period=1.0, ack_timeout=0.4, max_datagram=1400), seed=14)
    c.bootstrap(128, stagger=1.0)
    sizes = []
    original = c._send

    def spy(node: Swim, out: list[membership.Outgoing]) -> None:
        sizes.extend(len(o.data) for o in out)
        original(node, out)

    c._send = spy  # type: ignore[method-assign]
    c.run_for(5)
    assert sizes and max(sizes) <= 1400


# -- wire ---------------------------------------------------------------------------


def test_decode_refuses_what_is_not_a_message() -> None:
    me = ["a", "10.0.0.1:1", 1, 0, 0]
    cases = [
        {"t": "swim_gossip", "from": me},  # unknown kind
        {"t": "swim_ping", "from": me, "seq": 1, "to": "b", "u": []},  # missing d
        {"t": "swim_ping", "from": me, "seq": 1, "to": "b", "d": 0, "u": [], "x": 1},
        {"t": "swim_ping", "from": me, "seq": True, "to": "b", "d": 0, "u": []},
        {"t": "swim_ping", "from": ["a", "nohostport", 1, 0, 0], "seq": 1, "to": "b", "d": 0,
         "u": []},
        {"t": "swim_ack", "from": me, "seq": 1, "d": 0, "u": [["b", "h:1", 1, 0, 9]]},
        {"t": "swim_join", "from": me, "nonce": b"short"},
        {"t": "swim_join", "from": me, "nonce": b"n" * 16, "proof": b"p" * 32},
        {"t": "swim_sync", "from": me, "members": [], "reply": 1},
    ]
    for obj in cases:
        with pytest.raises(WireError) as err:
            decode(msgpack.packb(obj, use_bin_type=True))
        assert err.value.authentic, obj
    with pytest.raises(WireError):
        decode(b"\xc1")
    with pytest.raises(WireError) as err:
        ClusterAuth(TOKEN).open(b"\x02" + b"\0" * 40)
    assert not err.value.authentic


def test_bad_datagrams_from_members_become_events() -> None:
    a = Swim(Member("a", "10.0.0.1:1", 1), TOKEN)
    a.receive(ClusterAuth(TOKEN).seal(msgpack.packb({"t": "nope"})), "10.0.0.9:1", 0.0)
    assert [type(e) for e in a.take_events()] == [BadDatagram]


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1) | st.binary(max_size=40)
    | st.text(max_size=12) | st.sampled_from(["b", "10.0.0.2:1", "a"]),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=24)
_records = st.lists(st.sampled_from(["b", "a", "10.0.0.2:1"]) | st.integers(-1, 5)
                    | st.none(), min_size=5, max_size=5)
_fields = ["seq", "to", "d", "u", "for", "target", "nonce", "challenge", "proof", "members",
           "reply"]
_messages = st.fixed_dictionaries(
    {"t": st.sampled_from(sorted(KINDS)), "from": _records | _values},
    optional={k: _values | st.lists(_records, max_size=3) for k in _fields})


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=300) | _messages.map(lambda m: msgpack.packb(m, use_bin_type=True)))
def test_receive_never_raises(body: bytes) -> None:
    """Whatever a member (or a stranger) sends: an answer or nothing, never an exception."""
    a = Swim(Member("a", "10.0.0.1:1", 1), TOKEN)
    a.receive(ClusterAuth(TOKEN).seal(body), "10.0.0.9:1", 0.0)
    a.receive(body, "10.0.0.9:1", 0.0)
    a.tick(1.0)


# -- views --------------------------------------------------------------------------


def test_is_current() -> None:
    a = Swim(Member("a", "10.0.0.1:1", 10), TOKEN)
    assert a.is_current("a", 10) and not a.is_current("a", 9)
    assert not a.is_current("nobody", 1)
    a.join([], 0.0)
    a.leave(1.0)
    assert not a.is_current("a", 10) and a.me.state is LEFT


def test_config_is_checked() -> None:
    with pytest.raises(ValueError):
        SwimConfig(period=1.0, ack_timeout=1.0)
    with pytest.raises(ValueError, match="grace needs host checks"):
        SwimConfig(starved_grace=5.0)
    with pytest.raises(ValueError):
        Swim(Member("a", "h:1", 1), "text-token")  # type: ignore[arg-type]


def test_public_exports() -> None:
    assert sorted(n for n in dir(membership) if not n.startswith("_") and n != "sim") == [
        "AuthFailed", "BadDatagram", "ClusterAuth", "EmbeddedBackend", "EtcdBackend", "Member",
        "MemberAlive", "MemberDead", "MemberDegraded", "MemberJoined", "MemberLeft",
        "MemberRestarted", "MemberState", "MemberSuspect", "MembershipBackend", "MembershipError",
        "MembershipEvent", "Outgoing", "PeerLost", "StaleIncarnation", "Superseded", "Swim",
        "SwimConfig", "SwimStatistics", "new_incarnation",
    ]
