"""Deploy the server container to a SageMaker real-time endpoint with boto3: model, endpoint config, endpoint.

``serve/deploy.py`` is the thin entry point; the logic lives here so that it is tested (against moto's
SageMaker mock). The container is one of the images built from ``serve/Dockerfile.neuron`` or
``serve/Dockerfile.cpu`` and pushed to ECR; the model files (a Hugging Face directory, optionally with a
``drafter/`` subdirectory) come packed as ``model.tar.gz`` in S3 and land in ``/opt/ml/model``. Server flags
travel in the container environment as ``PEAGLE_SERVE_ARGS`` (the image's entry point appends them to
``python -m peagle_jax.serve serve``).

Example::

    python serve/deploy.py create --name peagle-smollm2 \\
        --image 123456789012.dkr.ecr.us-east-1.amazonaws.com/peagle:neuron \\
        --role arn:aws:iam::123456789012:role/SageMakerRole --model-data s3://bucket/smollm2/model.tar.gz \\
        --instance-type ml.inf2.xlarge --serve-args "--platform neuron --dtype bfloat16 --max-batch 8" --wait
    python serve/deploy.py delete --name peagle-smollm2
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys

from peagle_jax import errors
from peagle_jax.errors import UserError

NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")  # SageMaker resource names


@dataclasses.dataclass(frozen=True)
class Deployment:
    name: str  # the endpoint name; the model and endpoint config take it too
    image: str
    role: str
    model_data: str | None = None  # s3://.../model.tar.gz, unpacked into /opt/ml/model
    instance_type: str = "ml.inf2.xlarge"
    instance_count: int = 1
    serve_args: str = ""  # flags for python -m peagle_jax.serve; empty keeps the image's defaults
    # Start-up compiles every graph before /ping answers 200; give it time (SageMaker's default is short).
    startup_timeout_s: int = 1800
    region: str | None = None

    def check(self) -> None:
        if not NAME.match(self.name):
            raise UserError(f"--name {self.name!r}: 1-63 letters, digits and hyphens, starting with a letter or digit")
        if not self.role.startswith("arn:"):
            raise UserError(f"--role must be an IAM role ARN, got {self.role!r}")
        if self.model_data is not None and not self.model_data.startswith("s3://"):
            raise UserError(f"--model-data must be an s3:// URL of a model.tar.gz, got {self.model_data!r}")
        if self.instance_count < 1:
            raise UserError(f"--instance-count must be >= 1, got {self.instance_count}")
        if not 60 <= self.startup_timeout_s <= 3600:
            raise UserError(f"--startup-timeout must be in 60..3600 seconds, got {self.startup_timeout_s}")


def sagemaker_client(region: str | None = None):
    import boto3

    return boto3.client("sagemaker", region_name=region)


def create(dep: Deployment, client=None, *, wait: bool = False) -> dict:
    """Create the model, endpoint config and endpoint named ``dep.name``; returns their ARNs."""
    dep.check()
    sm = client or sagemaker_client(dep.region)
    container = {"Image": dep.image}
    if dep.serve_args:  # replaces the image's default flags (PEAGLE_SERVE_ARGS in the Dockerfile)
        container["Environment"] = {"PEAGLE_SERVE_ARGS": dep.serve_args}
    if dep.model_data:
        container["ModelDataUrl"] = dep.model_data
    model = sm.create_model(ModelName=dep.name, PrimaryContainer=container, ExecutionRoleArn=dep.role)
    variant = {
        "VariantName": "AllTraffic",
        "ModelName": dep.name,
        "InstanceType": dep.instance_type,
        "InitialInstanceCount": dep.instance_count,
        "ContainerStartupHealthCheckTimeoutInSeconds": dep.startup_timeout_s,
    }
    config = sm.create_endpoint_config(EndpointConfigName=dep.name, ProductionVariants=[variant])
    endpoint = sm.create_endpoint(EndpointName=dep.name, EndpointConfigName=dep.name)
    if wait:
        sm.get_waiter("endpoint_in_service").wait(EndpointName=dep.name)
    return {
        "model_arn": model["ModelArn"],
        "endpoint_config_arn": config["EndpointConfigArn"],
        "endpoint_arn": endpoint["EndpointArn"],
    }


def delete(name: str, client=None, region: str | None = None) -> None:
    """Delete the endpoint, endpoint config and model named ``name`` (those that exist)."""
    sm = client or sagemaker_client(region)
    for call, key in (
        (sm.delete_endpoint, "EndpointName"),
        (sm.delete_endpoint_config, "EndpointConfigName"),
        (sm.delete_model, "ModelName"),
    ):
        try:
            call(**{key: name})
        except sm.exceptions.ClientError as err:
            if "not found" not in str(err).lower() and "could not find" not in str(err).lower():
                raise


def build_parser() -> argparse.ArgumentParser:
    p = errors.ArgumentParser(prog="serve/deploy.py", description="Deploy peagle_jax.serve to SageMaker.")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("create", help="create model, endpoint config and endpoint")
    c.add_argument("--name", required=True, help="endpoint name (also used for the model and endpoint config)")
    c.add_argument("--image", required=True, help="ECR image URI built from serve/Dockerfile.neuron or .cpu")
    c.add_argument("--role", required=True, help="SageMaker execution role ARN")
    c.add_argument("--model-data", help="s3:// URL of model.tar.gz (HF model dir, optional drafter/ inside)")
    c.add_argument("--instance-type", default="ml.inf2.xlarge", help="instance type (default ml.inf2.xlarge)")
    c.add_argument("--instance-count", type=int, default=1, help="instances (default 1)")
    c.add_argument(
        "--serve-args",
        default="",
        help="server flags replacing the image's defaults, e.g. '--platform neuron --max-batch 8'",
    )
    c.add_argument("--startup-timeout", type=int, default=1800, help="seconds for warm-up before /ping (1800)")
    c.add_argument("--region", help="AWS region (default: the boto3 default)")
    c.add_argument("--wait", action="store_true", help="wait until the endpoint is InService")
    d = sub.add_parser("delete", help="delete endpoint, endpoint config and model")
    d.add_argument("--name", required=True)
    d.add_argument("--region")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "create":
            dep = Deployment(
                args.name,
                args.image,
                args.role,
                args.model_data,
                args.instance_type,
                args.instance_count,
                args.serve_args,
                args.startup_timeout,
                args.region,
            )
            for key, arn in create(dep, wait=args.wait).items():
                print(f"{key}: {arn}")
        else:
            delete(args.name, region=args.region)
            print(f"deleted {args.name}")
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
