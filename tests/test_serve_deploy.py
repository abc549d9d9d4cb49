"""The SageMaker deploy script against moto's SageMaker mock: the right calls with the right arguments."""

from __future__ import annotations

import pytest

from peagle_jax.errors import UserError
from peagle_jax.serve import deploy as D

ROLE = "arn:aws:iam::123456789012:role/SageMakerRole"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/peagle:neuron"


@pytest.fixture
def sagemaker(monkeypatch):
    from moto import mock_aws

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.setenv(key, "testing")
    with mock_aws():
        yield D.sagemaker_client("us-east-1")


def test_create_describes_model_config_and_endpoint(sagemaker):
    dep = D.Deployment(
        "peagle-test",
        IMAGE,
        ROLE,
        model_data="s3://bucket/smollm2/model.tar.gz",
        instance_type="ml.inf1.6xlarge",  # moto knows no inf2/trn1 types yet
        instance_count=2,
        serve_args="--platform neuron --max-batch 8",
        startup_timeout_s=1200,
    )
    arns = D.create(dep, sagemaker)
    assert arns["endpoint_arn"].endswith("endpoint/peagle-test")
    model = sagemaker.describe_model(ModelName="peagle-test")
    assert model["ExecutionRoleArn"] == ROLE
    container = model["PrimaryContainer"]
    assert container["Image"] == IMAGE and container["ModelDataUrl"] == "s3://bucket/smollm2/model.tar.gz"
    assert container["Environment"] == {"PEAGLE_SERVE_ARGS": "--platform neuron --max-batch 8"}
    config = sagemaker.describe_endpoint_config(EndpointConfigName="peagle-test")
    (variant,) = config["ProductionVariants"]
    assert variant["ModelName"] == "peagle-test" and variant["VariantName"] == "AllTraffic"
    assert (variant["InstanceType"], variant["InitialInstanceCount"]) == ("ml.inf1.6xlarge", 2)
    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] == 1200
    endpoint = sagemaker.describe_endpoint(EndpointName="peagle-test")
    assert endpoint["EndpointConfigName"] == "peagle-test"
    D.delete("peagle-test", sagemaker)
    assert sagemaker.list_endpoints()["Endpoints"] == [] and sagemaker.list_models()["Models"] == []
    assert sagemaker.list_endpoint_configs()["EndpointConfigs"] == []
    D.delete("peagle-test", sagemaker)  # deleting what is gone is not an error


def test_cli_create_prints_arns(sagemaker, monkeypatch, capsys):
    monkeypatch.setattr(D, "sagemaker_client", lambda region=None: sagemaker)
    argv = ["create", "--name", "cli-ep", "--image", IMAGE, "--role", ROLE, "--instance-type", "ml.c5.xlarge"]
    assert D.main(argv) == 0
    out = capsys.readouterr().out
    assert "endpoint_arn: arn:aws:sagemaker:" in out and "cli-ep" in out
    container = sagemaker.describe_model(ModelName="cli-ep")["PrimaryContainer"]
    assert "ModelDataUrl" not in container and not container.get("Environment")  # the image's defaults hold
    assert D.main(["delete", "--name", "cli-ep"]) == 0


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"name": "bad_name"}, "--name"),
        ({"role": "SageMakerRole"}, "--role"),
        ({"model_data": "/local/model.tar.gz"}, "--model-data"),
        ({"instance_count": 0}, "--instance-count"),
        ({"startup_timeout_s": 5}, "--startup-timeout"),
    ],
)
def test_bad_arguments_are_refused_before_any_call(kwargs, message):
    class NoCalls:
        def __getattr__(self, name):
            raise AssertionError(f"unexpected call {name}")

    dep = D.Deployment(**{"name": "ok", "image": IMAGE, "role": ROLE, **kwargs})
    with pytest.raises(UserError, match=message):
        D.create(dep, NoCalls())
