"""Example clients for python -m peagle_jax.serve.

    python serve/client_example.py                                   # local server, streamed chat
    python serve/client_example.py --base-url http://host:8080/v1 --model smollm2 --prompt "Hi"
    python serve/client_example.py --sagemaker-endpoint peagle-smollm2 --region us-east-1

A local (or any OpenAI-compatible) server is called with the official ``openai`` client; a SageMaker
endpoint with boto3's ``sagemaker-runtime`` ``invoke_endpoint`` and a chat-completions body, which the
container's ``/invocations`` accepts as it is.
"""

from __future__ import annotations

import argparse
import json


def openai_chat(base_url: str, model: str, prompt: str, max_tokens: int) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="unused")
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
    )
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        if chunk.usage:
            print(f"\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens]")


def sagemaker_chat(endpoint: str, region: str | None, model: str, prompt: str, max_tokens: int) -> None:
    import boto3

    runtime = boto3.client("sagemaker-runtime", region_name=region)
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    response = runtime.invoke_endpoint(
        EndpointName=endpoint, ContentType="application/json", Body=json.dumps({**body, "temperature": 0})
    )
    out = json.loads(response["Body"].read())
    print(out["choices"][0]["message"]["content"])
    print(f"[usage: {out['usage']}]")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="OpenAI-compatible base URL")
    p.add_argument("--model", default="smollm2", help="served model name (GET /v1/models)")
    p.add_argument("--prompt", default="Write a haiku about speculative decoding.")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--sagemaker-endpoint", help="call this SageMaker endpoint instead of --base-url")
    p.add_argument("--region", help="AWS region of the endpoint")
    args = p.parse_args()
    if args.sagemaker_endpoint:
        sagemaker_chat(args.sagemaker_endpoint, args.region, args.model, args.prompt, args.max_tokens)
    else:
        openai_chat(args.base_url, args.model, args.prompt, args.max_tokens)


if __name__ == "__main__":
    main()
