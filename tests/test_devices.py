"""Device specification strings: parse, format, thread budgets, errors."""

from __future__ import annotations

import pytest

from xmc_engine.devices import DeviceSpec, format_devices, parse_devices
from xmc_engine.errors import DeviceSpecError


def test_two_cpus_with_speed():
    d = parse_devices("cpu,cpu@0.5", cores=8)
    assert d == [DeviceSpec("cpu", None, 1.0, 4), DeviceSpec("cpu", None, 0.5, 4)]


def test_gpus_shared_and_thread_budget():
    d = parse_devices("cuda:0, cuda:0 ,cuda:1@0.25", cores=8)
    assert [x.name for x in d] == ["cuda:0", "cuda:0", "cuda:1"]
    assert [x.speed for x in d] == [1.0, 1.0, 0.25]
    assert all(x.threads == 1 for x in d)


def test_mixed_cpu_threads_split_among_cpu_devices_only():
    d = parse_devices("cuda:0,cpu*3", cores=7)
    assert [x.threads for x in d] == [1, 2, 2, 2]


def test_repeat_count_and_min_one_thread():
    d = parse_devices("cpu@.5*3", cores=2)
    assert len(d) == 3 and all(x.speed == 0.5 and x.threads == 1 for x in d)


@pytest.mark.parametrize("n_gpus,cores,expected", [
    (2, 16, "cuda:0,cuda:1"), (0, 2, "cpu"), (0, 1, "cpu"), (0, 8, "cpu,cpu,cpu,cpu"),
    (0, 64, ",".join(["cpu"] * 8)),
])
def test_auto(n_gpus, cores, expected):
    assert format_devices(parse_devices("auto", cores=cores, n_gpus=n_gpus)) == expected


@pytest.mark.parametrize("spec", ["cpu", "cpu,cpu@0.5", "cuda:0,cuda:0,cuda:1@0.75",
                                  "cpu@0.125,cuda:3"])
def test_format_round_trip(spec):
    d = parse_devices(spec, cores=4)
    assert format_devices(d) == spec
    assert parse_devices(format_devices(d), cores=4) == d


@pytest.mark.parametrize("spec,bad", [
    ("", "empty"), ("   ", "empty"), ("gpu", "gpu"), ("cpu,tpu:0", "tpu"), ("cuda", "cuda"),
    ("cuda:", "cuda:"), ("cuda:-1", "cuda:-1"), ("cuda:x", "cuda:x"), ("cpu@0", "cpu@0"),
    ("cpu@1.5", "cpu@1.5"), ("cpu@-0.5", "cpu@-0.5"), ("cpu@fast", "cpu@fast"),
    ("cpu@", "cpu@"), ("cpu,", "empty entry"), ("cpu,,cpu", "empty entry"), ("cpu;cpu", "cpu;cpu"),
    ("cpu x", "cpu x"), ("cpu:0", "cpu:0"), ("cpu*0", "cpu*0"), ("cpu@nan", "cpu@nan"),
    ("cpu@inf", "cpu@inf"), ("auto,cpu", "auto"),
])
def test_bad_specs_name_the_entry_and_the_grammar(spec, bad):
    with pytest.raises(DeviceSpecError) as ei:
        parse_devices(spec, cores=4)
    msg = str(ei.value)
    assert bad in msg
    assert "cuda:N" in msg  # the grammar is shown


def test_dataclass_validates():
    with pytest.raises(DeviceSpecError):
        DeviceSpec("cuda")
    with pytest.raises(DeviceSpecError):
        DeviceSpec("cpu", speed=0.0)
