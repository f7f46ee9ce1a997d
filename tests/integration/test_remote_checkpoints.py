"""--checkpoint_uri against a real S3-compatible server (moto's server mode on 127.0.0.1): complete checkpoints are
uploaded, marker last; with output_dir gone, the same command resumes from the server and ends as if never
stopped; bad credentials, a missing bucket or an unreachable endpoint stop the run before training."""

import json
import subprocess
import time

import pytest

from conftest import BIN, free_port, loaded, max_weight_difference, train

from trainer_ext.checkpoints.format import MARKER

pytestmark = [pytest.mark.launch]

pytest.importorskip("s3fs")
pytest.importorskip("moto")

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """A real HTTP S3 endpoint with one bucket, 'checkpoints'."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "server.log", "w")
    server = subprocess.Popen([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], stdout=log,
                              stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                          region_name="us-east-1")
    deadline = time.time() + 60
    while True:
        try:
            client.create_bucket(Bucket="checkpoints")
            break
        except Exception:  # noqa: BLE001 - not listening yet
            if time.time() > deadline:
                raise
            time.sleep(0.5)
    yield endpoint, client
    server.terminate()
    server.wait(timeout=30)


def remote_names(client, prefix):
    listing = client.list_objects_v2(Bucket="checkpoints", Prefix=prefix)
    return sorted(item["Key"][len(prefix):] for item in listing.get("Contents", []))


@pytest.mark.oldest
def test_checkpoints_go_to_the_server_and_a_wiped_output_dir_resumes_from_it(s3_server, uninterrupted, tmp_path):
    """Stop after 10 steps, delete output_dir: the same command downloads checkpoint-10 and finishes = one run."""
    endpoint, client = s3_server
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
    flags = ["--checkpoint_uri", "s3://checkpoints/run1", "--save_total_limit", 1]
    output_dir = tmp_path / "run"
    train(output_dir, tmp_path / "first", 8, 2, *flags, "--max_steps", 10, env=env)
    keys = remote_names(client, "run1/")
    assert {key.split("/")[0] for key in keys} == {"checkpoint-10"}  # 4 and 8 rotated away there too
    assert f"checkpoint-10/{MARKER}" in keys and "checkpoint-10/model.safetensors" in keys
    assert json.loads(client.get_object(Bucket="checkpoints", Key=f"run1/checkpoint-10/{MARKER}")["Body"].read())[
        "step"] == 10

    import shutil

    shutil.rmtree(output_dir)  # the machine is gone
    # The new machine has no AWS variables: the credentials come in --checkpoint_storage_options, and no log, no
    # TensorBoard event file (the arguments as text and hparams) and no other output file shows them.
    secret = "never-SHOWN-7f3a"
    options = json.dumps({"key": "testing", "secret": secret, "client_kwargs": {"endpoint_url": endpoint}})
    out = train(output_dir, tmp_path / "second", 8, 2, *flags, "--max_steps", 14, "--checkpoint_storage_options",
                options, "--report_to", "tensorboard",
                env={"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_EC2_METADATA_DISABLED": "true",
                     "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent",
                     "TENSORBOARD_LOGGING_DIR": str(output_dir / "tensorboard")})
    text = out.stdout + out.stderr
    assert secret not in text
    # training_args.bin is the pickled arguments, as transformers saves them (hub_token included): docs/operations.md
    shown = [path for path in output_dir.rglob("*") if path.is_file() and path.name != "training_args.bin"
             and secret.encode() in path.read_bytes()]
    assert shown == [] and list((output_dir / "tensorboard").rglob("events.out.tfevents.*"))
    assert "downloaded s3://checkpoints/run1/checkpoint-10" in text
    assert f"resuming from {output_dir / 'checkpoint-10'}" in text
    for rank in range(2):
        assert loaded(tmp_path / "second", rank) == loaded(uninterrupted / "indices", rank)[10 * 8:]
    assert max_weight_difference(uninterrupted / "run", output_dir) < 1e-5
    assert {key.split("/")[0] for key in remote_names(client, "run1/")} == {"checkpoint-14"}


@pytest.mark.parametrize("problem", ["no credentials", "no bucket", "unreachable"])
def test_a_unusable_checkpoint_uri_stops_before_training(s3_server, tmp_path, problem):
    """A --checkpoint_uri that cannot take a write stops the run, named, before one sample is loaded."""
    endpoint, _ = s3_server
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
    uri, expected = "s3://checkpoints/run2", ""
    if problem == "no credentials":
        env = {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
               "AWS_CONFIG_FILE": "/nonexistent", "AWS_EC2_METADATA_DISABLED": "true", "AWS_ENDPOINT_URL": endpoint}
        expected = "AWS_ACCESS_KEY_ID"
    elif problem == "no bucket":
        uri, expected = "s3://no-such-bucket/run", "create the bucket"
    else:
        env["AWS_ENDPOINT_URL"], expected = f"http://127.0.0.1:{free_port()}", "check the endpoint"
    out = train(tmp_path / "run", tmp_path / "indices", 8, 1, "--checkpoint_uri", uri, "--max_steps", 3, env=env,
                check=False)
    assert out.returncode != 0
    assert f"--checkpoint_uri {uri}: cannot use it" in out.stderr and expected in out.stderr, out.stderr[-3000:]
    recorded = tmp_path / "indices" / "rank0.txt"
    assert not recorded.exists() or not recorded.read_text()  # not one sample loaded (checked before the data, too)


def test_a_local_path_works_as_checkpoint_uri(tmp_path):
    """Any fsspec URL, a plain folder included (e.g. a mounted network disk)."""
    remote = tmp_path / "mounted"
    train(tmp_path / "run", tmp_path / "indices", 8, 1, "--checkpoint_uri", remote, "--max_steps", 4)
    assert (remote / "checkpoint-4" / MARKER).is_file() and (remote / "checkpoint-4" / "model.safetensors").is_file()
    assert not any(p.name.startswith(".trainer_ext-write-check") for p in remote.iterdir())
