"""Alert rules (issue 14 §4): deploy/prometheus/alerts.yml passes `promtool check rules`, the
scrape config `promtool check config`, and every alert has its own unit-test file in
deploy/prometheus/tests/ that `promtool test rules` passes, with a case where the alert fires and
one where it does not.
"""

import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
PROMTOOL = Path("/usr/bin/promtool")


def promtool(*args):
    assert PROMTOOL.is_file(), f"{PROMTOOL} is missing: apt-get install prometheus"
    return subprocess.run([str(PROMTOOL), *args], capture_output=True, text=True, timeout=120,
                          cwd=PROMETHEUS_DIR)


def alert_names():
    rules = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())
    return [r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r]


def test_rules_and_config_pass_promtool_checks():
    check = promtool("check", "rules", "alerts.yml")
    assert check.returncode == 0, (check.stdout, check.stderr)
    assert f"SUCCESS: {len(alert_names())} rules found" in check.stdout, check.stdout
    config = promtool("check", "config", "prometheus.yml")
    assert config.returncode == 0, (config.stdout, config.stderr)


def test_every_alert_is_required_and_unit_tested():
    required = {"QuantdDown", "QuantdJobFailed", "QuantdJobStalled", "QuantdTaskRetriesRising",
                "QuantdDiskNearlyFull", "QuantdSchedulerNotTicking",
                "QuantdJobsQueuedNoWorkerConnected"}
    names = alert_names()
    assert len(names) == len(set(names)), names
    assert required <= set(names), sorted(required - set(names))
    files = sorted((PROMETHEUS_DIR / "tests").glob("*.yml"))
    fires, silent = {}, {}
    for f in files:
        spec = yaml.safe_load(f.read_text())
        assert spec["rule_files"] == ["../alerts.yml"], f
        for test in spec["tests"]:
            for case in test.get("alert_rule_test", []):
                target = fires if case.get("exp_alerts") else silent
                target.setdefault(case["alertname"], set()).add(f.name)
    for name in names:
        assert name in fires, f"no test case where {name} fires"
        assert name in silent, f"no test case where {name} stays silent"
        # One file per alert, named after it (QuantdJobFailed -> quantd_job_failed.yml).
        snake = "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")
        assert fires[name] == {f"{snake}.yml"}, (name, fires[name])


def test_promtool_unit_tests_pass():
    files = sorted(p.relative_to(PROMETHEUS_DIR) for p in (PROMETHEUS_DIR / "tests").glob("*.yml"))
    assert files
    result = promtool("test", "rules", *map(str, files))
    assert result.returncode == 0, (result.stdout, result.stderr)
    assert result.stdout.count("SUCCESS") == len(files), result.stdout
