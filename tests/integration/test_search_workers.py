"""`trainer-ext search` on several machines: workers (each its own study folder, some under another host name, as on
another machine) share one Optuna study on a real PostgreSQL server started for the tests; a worker killed like a
machine that dies has its trial failed as stale by Optuna's heartbeat and its retry continued by another from the
remote checkpoint copy (moto's S3 server), the dead worker rejoins, and the study ends with exactly max_trials trials
and that one retry, none run twice, the remote copies cleaned up."""

import json
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import REPO, clean_env, free_port
from test_remote_checkpoints import CREDENTIALS, remote_names, s3_server  # noqa: F401 - the fixture
from test_search import ENV, TINY, TRAINER_EXT, runs_in, tiny_search
from trainer_ext.checkpoints.format import newest_valid_checkpoint, publish
from trainer_ext.search.copies import fetch_checkpoint
from trainer_ext.search.study import retried_from

optuna = pytest.importorskip("optuna")
# Debian's packages install the server beside its version; elsewhere initdb is on PATH.
DEBIAN_POSTGRES = "/usr/lib/postgresql/*/bin"


def postgres_bin() -> Path | None:
    if shutil.which("initdb") and shutil.which("pg_ctl"):
        return Path(shutil.which("initdb")).parent
    found = sorted(Path("/").glob(DEBIAN_POSTGRES.lstrip("/")), key=lambda path: int(path.parent.name)
                   if path.parent.name.isdigit() else 0)
    return found[-1] if found and (found[-1] / "initdb").is_file() else None


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server of our own on 127.0.0.1 and a free port (initdb + pg_ctl in a temporary folder, as the
    `postgres` user when the tests run as root), shared by every test here: its URL without a database."""
    bindir = postgres_bin()
    if bindir is None:
        pytest.skip("PostgreSQL's server is not installed (initdb, pg_ctl): apt-get install postgresql, or put its "
                    "bin folder on PATH")
    pytest.importorskip("psycopg", reason="psycopg is not installed: pip install 'trainer_ext[search-postgres]'")
    root = Path(tempfile.mkdtemp(prefix="trainer-ext-postgres-"))  # not under pytest's folder: root-only
    as_user = []
    if os.geteuid() == 0:  # the server refuses to run as root
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("the tests run as root and there is no 'postgres' user to run PostgreSQL's server as")
        os.chown(root, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    port, data = free_port(), root / "data"
    subprocess.run([*as_user, bindir / "initdb", "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8",
                    "--no-sync"], check=True, capture_output=True)
    options = f"-h 127.0.0.1 -p {port} -k {root} -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
    subprocess.run([*as_user, bindir / "pg_ctl", "-D", data, "-o", options, "-l", root / "server.log", "-w", "start"],
                   check=True, capture_output=True)
    yield f"postgresql://postgres@127.0.0.1:{port}"
    subprocess.run([*as_user, bindir / "pg_ctl", "-D", data, "-m", "immediate", "stop"], capture_output=True)
    shutil.rmtree(root, ignore_errors=True)


def new_database(server: str, name: str) -> str:
    import psycopg

    with psycopg.connect(f"{server}/postgres", autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')
    return f"{server}/{name}"


def worker(path, study_dir: Path, log: Path, env: dict, host: str | None = None) -> subprocess.Popen:
    """`trainer-ext search` with its own study folder; `host`: under that host name (a UTS namespace, as root), as
    on another machine."""
    command = [str(TRAINER_EXT), "search", str(path), "--study_dir", str(study_dir)]
    if host:
        command = ["unshare", "--uts", "sh", "-c", f'hostname {host} && exec "$@"', "sh", *command]
    with open(log, "w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**clean_env(), **ENV, **env}, start_new_session=True)


def kill_machine(process: subprocess.Popen) -> None:
    """SIGKILL to the worker and every process under it at once (stopped first, so none checkpoints or cleans up):
    what a machine that dies does."""
    import psutil

    worker = psutil.Process(process.pid)
    for action in ("suspend", "kill"):
        for each in [worker, *worker.children(recursive=True)]:
            try:
                getattr(each, action)()
            except psutil.NoSuchProcess:  # exited meanwhile
                pass
    process.wait()


def wait_for(condition, what: str, logs: list[Path], timeout: float = 300):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"waited {timeout} s for {what}:\n" + "\n".join(
            f"--- {log}\n{log.read_text()[-3000:]}" for log in logs if log.is_file())
        time.sleep(0.2)


def trials_of(url: str) -> list:
    try:
        return optuna.load_study(study_name="search", storage=url).get_trials()
    except KeyError:  # no study yet
        return []


@pytest.mark.launch
@pytest.mark.model_package
def test_two_machines_share_a_study_and_one_continues_the_trial_of_the_other_that_died(postgres, s3_server, tmp_path):
    """Worker A (host machine-a) and B share a 6-trial study on PostgreSQL, checkpoints copied to S3. A dies like a
    machine mid-trial; Optuna's stale check on B fails A's trial once its heartbeat is 4 s old and queues a retry,
    which B continues from the remote checkpoint in the trial's folder (its steps not re-run, its result equal to a
    trial with the same values run whole); A rejoins as a new worker. The study ends with 6 trials and the retry of
    the dead one, none run twice; each worker's report names the host of each run and the takeover; best/ is a real
    folder on the worker that did not run the best trial; only the best trial's remote copy is left."""
    endpoint, client = s3_server
    url = new_database(postgres, "two_machines")
    # The seeded sampler draws 3e-4 for trials 0, 1, 3, 5 and 1e-4 for 2, 4: every trial has a twin.
    path = tiny_search(tmp_path, {"max_trials": 6, "metric": "loss", "storage": url, "heartbeat_interval": 1,
                                  "grace_period": 4, "space": {"learning_rate": [1.0e-4, 3.0e-4]}},
                       checkpoint_uri="s3://checkpoints/study", eval_strategy="no", **TINY)
    env, host = {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}, os.uname().nodename
    first, second, again = tmp_path / "a.log", tmp_path / "b.log", tmp_path / "a-again.log"
    logs = [first, second, again]
    a = worker(path, tmp_path / "a", first, env, host="machine-a")
    b = worker(path, tmp_path / "b", second, env)
    wait_for(lambda: any(trial.user_attrs.get("owner", {}).get("host") == "machine-a" for trial in trials_of(url)),
             "A's first trial", logs)
    killed = next(trial.number for trial in trials_of(url) if trial.user_attrs["owner"]["host"] == "machine-a")
    wait_for(lambda: "checkpoint-2/checkpoint_complete.json" in remote_names(client, f"study/trial-{killed}/"),
             f"trial {killed}'s first remote checkpoint", logs)
    kill_machine(a)
    remote = remote_names(client, f"study/trial-{killed}/")
    assert "checkpoint-6/checkpoint_complete.json" not in remote and trials_of(url)[killed].state.name == "RUNNING", \
        "the kill must land mid-trial"

    wait_for(lambda: any(retried_from(trial) == killed and trial.state.name == "RUNNING" for trial in trials_of(url)),
             "B continuing the trial's retry", logs)
    a = worker(path, tmp_path / "a", again, env, host="machine-a")
    assert b.wait(timeout=600) == 0 and a.wait(timeout=600) == 0, "\n".join(log.read_text()[-3000:] for log in logs)

    study = optuna.load_study(study_name="search", storage=url)
    trials = study.get_trials()
    retry = next(trial.number for trial in trials if retried_from(trial) == killed)
    assert [trial.number for trial in trials] == list(range(7)) and [retried_from(t) for t in trials].count(None) == 6
    assert [trial.state.name for trial in trials].count("COMPLETE") == 6 and trials[killed].state.name == "FAIL"
    ran = {trial.number: [run[0] for run in trial.user_attrs["history"]] for trial in trials}
    assert ran.pop(killed) == ["machine-a"] and ran.pop(retry) == ["machine-a", host]
    assert trials[retry].user_attrs["takeovers"] == 1 and trials[retry].user_attrs["runs"] == 2
    assert all(len(hosts) == 1 for hosts in ran.values()), ran  # none run twice
    ran[killed] = ran[retry] = ["machine-a", host]
    for trial in trials:  # each run's log on the machine that ran it, in the original trial's folder
        number = killed if trial.number == retry else trial.number
        logged = [runs_in(log) if (log := folder / f"trial-{number}" / "trial.log").is_file() else 0
                  for folder in (tmp_path / "a", tmp_path / "b")]
        assert logged == [ran[trial.number].count("machine-a"), ran[trial.number].count(host)], trial.number
    rejoined = again.read_text()
    assert any(ran[number] == ["machine-a"] and f"trial {number} starts" in rejoined for number in ran
               if number != killed), \
        rejoined[-3000:]  # the dead worker came back as a new worker and ran a trial

    # Continued from the remote copy: the steps before it were not trained again, the result is a whole run's.
    said = second.read_text()
    assert f"trial {retry} (retry of trial {killed}): taken over from machine-a:" in said, said
    assert "no heartbeat from its worker for 4 s: Optuna failed it as stale" in said
    step = int(said.split(f"continues from s3://checkpoints/study/trial-{killed}/checkpoint-")[1].split(" ")[0])
    assert 2 <= step < 6
    log = (tmp_path / "b" / f"trial-{killed}" / "trial.log").read_text()
    assert f"resuming from {tmp_path / 'b' / f'trial-{killed}' / f'checkpoint-{step}'}" in log
    assert "'loss'" in log and f"'step': {step}," not in log.split("resuming from")[1]
    twins = [trial for trial in trials if trial.params == trials[killed].params and trial.number not in (killed, retry)]
    assert twins and all(abs(trial.value - trials[retry].value) < 1e-5 for trial in twins)

    # Reports: hosts per trial, the takeover; best/ on both workers; remote copies of the non-best trials removed.
    best = study.best_trial
    for folder, name in ((tmp_path / "a", "machine-a"), (tmp_path / "b", host)):
        table = (folder / "search_results.md").read_text()
        assert "| hosts" in table and "| takeovers" in table and f"machine-a, {host}" in table, table
        assert f"taken over from a gone worker: trial {retry}" in table and "FAIL (retried)" in table
        assert (folder / "workers.png").stat().st_size > 1000
        assert (folder / "best" / "model.safetensors").is_file(), table
        if ran[best.number][-1] == name:
            assert (folder / "best").resolve() == folder / f"trial-{killed if best.number == retry else best.number}"
        else:
            assert not (folder / "best").is_symlink()
            assert json.loads((folder / "best" / "search_trial.json").read_text())["trial"] == best.number
            assert f"(copied from s3://checkpoints/study/trial-{best.number}/model)" in table
    left = {name.split("/")[0] for name in remote_names(client, "study/")}
    assert left == {f"trial-{killed if best.number == retry else best.number}"}


def published(folder: Path, step: int) -> Path:
    """A complete checkpoint-<step> (marker with sizes and checksums) in `folder`."""
    staged = folder / ".staging" / f"checkpoint-{step}"
    staged.mkdir(parents=True)
    (staged / "model.safetensors").write_bytes(bytes(step))
    (staged / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return publish(staged, folder, {"step": step})


def test_a_trial_taken_over_on_the_same_machine_continues_from_the_other_workers_folder(tmp_path):
    """A worker taking over a trial last run in another study folder on its machine copies that folder's newest
    complete checkpoint into its own (else the trial would start over); from another machine without a remote copy,
    the trial restarts from step 0 with the same values, and the line says why."""
    theirs, mine, third = tmp_path / "a" / "trial-3", tmp_path / "b" / "trial-3", tmp_path / "c" / "trial-3"
    for folder, steps in ((theirs, (2, 4)), (mine, (2,)), (third, ())):
        folder.mkdir(parents=True)
        for step in steps:
            published(folder, step)
    me, last_run = {"host": "here"}, {"owner": {"host": "here", "pid": 1}, "trial_dir": str(theirs)}
    assert fetch_checkpoint(last_run, mine, me, None) == f"continues from {theirs / 'checkpoint-4'} (copied here)"
    assert newest_valid_checkpoint(mine, checksums=True) == mine / "checkpoint-4"
    assert not (mine / ".staging" / "checkpoint-4").exists()
    assert fetch_checkpoint(last_run, mine, me, None) == f"continues from {mine / 'checkpoint-4'}"  # nothing newer
    elsewhere = {"owner": {"host": "there", "pid": 1}, "trial_dir": str(theirs)}
    assert fetch_checkpoint(elsewhere, third, me, None) == (
        f"restarts from step 0 with the same values: the checkpoints in there:{theirs} are out of reach (give "
        "--checkpoint_uri to continue from a remote copy)")


def test_optunas_heartbeat_on_sqlite_fails_a_silent_trial_and_queues_its_retry_in_the_same_folder(tmp_path):
    """Liveness is Optuna's, on SQLite too (the default storage): a trial whose heartbeat stopped (its worker killed,
    or only stopped) is FAIL after the grace period and queued again with its values and attributes; the retry keeps
    the original's folder number; a worker stopping cleanly hands its trial on at once, without waiting."""
    import warnings

    from trainer_ext.integrations import internals
    from trainer_ext.search.study import fail_stale_trials, folder_number, hand_on, retried, storage

    url = f"sqlite:///{tmp_path}/study.db"
    database = storage(url, heartbeat_interval=1, grace_period=2)
    study = optuna.create_study(storage=database, study_name="s")
    space = {"x": optuna.distributions.FloatDistribution(0, 1)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = study.ask(space)
    first.set_user_attr("trial_dir", "/a/trial-0")
    beat = internals.optuna_heartbeat_thread(internals.optuna_trial_id(first), database)
    beat.start()
    time.sleep(3)  # beating: not stale after the grace period
    fail_stale_trials(study)
    assert study.trials[0].state.name == "RUNNING"
    beat.join()  # the worker is gone: no more heartbeats
    time.sleep(3.5)  # SQLite's clock has whole seconds
    fail_stale_trials(study)
    fail_stale_trials(optuna.load_study(study_name="s", storage=storage(url, 1, 2)))  # another worker: no 2nd retry
    failed, retry = study.trials
    assert failed.state.name == "FAIL" and retry.state.name == "WAITING" and retried_from(retry) == 0
    assert retry.params == failed.params and retry.user_attrs["trial_dir"] == "/a/trial-0"
    assert folder_number(retry) == 0 and folder_number(failed) == 0 and retried(study.trials) == {0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        continued = study.ask(space)  # a worker's next ask continues the retry
    assert continued.number == 1 and continued.params == failed.params

    hand_on(study, database, study.trials[1])  # stopped cleanly: no grace period
    assert [trial.state.name for trial in study.trials] == ["FAIL", "FAIL", "WAITING"]
    assert retried_from(study.trials[2]) == 0 and folder_number(study.trials[2]) == 0
