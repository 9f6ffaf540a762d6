"""Starvation is loud (`rollstream.broker.starvation`): a job whose
trajectories are nearly all filtered or stale, or whose consumer waits with
nothing becoming ready, raises an alarm naming the cause and figures (a
log line, a gauge, `status`), and the alarm ends when it no longer holds."""
import logging

from broker_helpers import end_msg, turn_msg
from test_broker_checkpoint import Node

from rollstream.broker.starvation import Starvation

P = b"producer"


def test_a_window_mostly_filtered_raises_the_filtered_alarm_and_it_ends_when_the_window_recovers():
    watch = Starvation(window=60.0, share=0.9, min_trajectories=8, idle_after=120.0)
    watch.dropped("default", "filtered", 9)
    watch.kept("default", 1)
    [alarm] = watch.check(10.0, {}, {})
    assert (alarm.job, alarm.cause, alarm.started) == ("default", "filtered", True)
    assert (alarm.figures["filtered"], alarm.figures["kept"], alarm.figures["finished"]) == (9, 1, 10)
    assert watch.active() == {"default": ["filtered"]} and watch.check(20.0, {}, {}) == []  # said once
    watch.kept("default", 2)
    [ended] = watch.check(30.0, {}, {})  # 9 of 12: below 0.9
    assert (ended.cause, ended.started) == ("filtered", False) and watch.active() == {}


def test_too_few_trajectories_or_an_old_window_raise_nothing():
    watch = Starvation(window=60.0, share=0.9, min_trajectories=8)
    watch.dropped("default", "stale", 7)
    assert watch.check(1.0, {}, {}) == []  # 7 < 8 finished
    watch.dropped("default", "stale", 1)
    assert [a.cause for a in watch.check(2.0, {}, {})] == ["stale"]
    assert [(a.cause, a.started) for a in watch.check(100.0, {}, {})] == [("stale", False)]  # out of the window


def test_a_waiting_consumer_with_nothing_ready_is_idle_after_the_set_time():
    watch = Starvation(idle_after=120.0)
    assert watch.check(0.0, {"default": True}, {}) == []  # the clock starts
    assert watch.check(119.0, {"default": True}, {}) == []
    [alarm] = watch.check(121.0, {"default": True}, {})
    assert (alarm.cause, alarm.started, alarm.figures["idle_s"]) == ("idle", True, 121.0)
    watch.kept("default", 4)
    [ended] = watch.check(122.0, {"default": True}, {"default": 1})
    assert (ended.cause, ended.started) == ("idle", False)


def test_the_broker_warns_names_the_cause_in_status_and_clears_it(tmp_path, caplog):
    node = Node(tmp_path / "data", group_filters="all_equal_rewards", starvation_window=30.0, starvation_after=5.0)
    messages = []
    for g in range(5):
        for i in range(2):
            tid = f"g{g}-{i}"
            messages += [turn_msg(tid, 0, seq=4 * g + 2 * i, group=(f"g{g}", 2)), end_msg(tid, seq=4 * g + 2 * i + 1)]
    node.run(node.core.producer_read([(P, m, None) for m in messages], node.clock))
    node.hello(run=None)
    node.say("credit", n=4, unit="trajectory")
    with caplog.at_level(logging.WARNING, logger="rollstream.broker"):
        node.housekeep()
    [line] = [r for r in caplog.records if "starving" in r.getMessage()]
    assert "job 'default' is starving: its group filters dropped nearly every complete group" in line.getMessage()
    assert (line.cause, line.filtered, line.kept) == ("filtered", 10, 0)
    status = node.core.status(node.clock)
    assert status["starving"] == {"default": ["filtered"]}
    assert node.core.metrics.starving.labels(job="default", cause="filtered")._value.get() == 1
    node.now += 31.0  # the window moves on; the consumer still waits with nothing ready
    node.say("heartbeat")
    node.housekeep()
    assert node.core.status(node.clock)["starving"] == {"default": ["idle"]}
    assert node.core.metrics.starving.labels(job="default", cause="filtered")._value.get() == 0
