"""A Tessera client in Python over the gateway's public gRPC API (`tessera.v1.TextGeneration`).

The stubs are generated from protos/generate.proto when the script starts (grpcio-tools);
without grpcio-tools it falls back to the copies a Tessera checkout generates into
services/pb. It shows four things:

1. a chat streamed with n=2, each chunk naming its choice (`index`), with per-token logprobs;
2. an answer constrained to a JSON schema (`structured_outputs.json`);
3. a tool call: the tool offered and forced with `tool_choice`, the parsed call returned;
4. the usage of each answer.

    python client.py [--gateway 127.0.0.1:50052] [--api-key KEY] [--prompt "..."]

The API key (when the gateway has one) goes as `authorization: Bearer KEY` metadata
(--api-key or the TESSERA_API_KEY variable). The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc

PROTOS = Path(__file__).resolve().parents[3] / "protos"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
    },
    "required": ["city", "country"],
    "additionalProperties": False,
}
WEATHER_ARGS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}},
    "required": ["city"],
    "additionalProperties": False,
}


def load_stubs() -> tuple[ModuleType, ModuleType]:
    """generate_pb2 and generate_pb2_grpc, compiled from the .proto now (or services.pb)."""
    try:
        from grpc_tools import protoc
    except ImportError:
        sys.path.insert(0, str(PROTOS.parent))
        return (
            importlib.import_module("services.pb.generate_pb2"),
            importlib.import_module("services.pb.generate_pb2_grpc"),
        )
    out = tempfile.mkdtemp(prefix="tessera-stubs-")
    include = str(Path(protoc.__file__).parent / "_proto")
    argv = [
        "protoc",
        f"-I{PROTOS}",
        f"-I{include}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
    ]
    if protoc.main([*argv, str(PROTOS / "generate.proto")]) != 0:
        raise RuntimeError("protoc could not compile generate.proto")
    sys.path.insert(0, out)
    return importlib.import_module("generate_pb2"), importlib.import_module("generate_pb2_grpc")


def stream_two_choices(stub: Any, pb: ModuleType, prompt: str, meta: list[Any]) -> dict[str, Any]:
    """ChatStream with n=2 and logprobs: text per choice, the first tokens' logprobs."""
    params = pb.TextSamplingParams(
        n=2, max_tokens=24, temperature=0.8, seed=1, logprobs=True, top_logprobs=2
    )
    request = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content=prompt)], params=params)
    choices: dict[int, dict[str, Any]] = {}
    usage: dict[str, int] = {}
    for chunk in stub.ChatStream(request, metadata=meta):
        choice = choices.setdefault(
            chunk.index, {"index": chunk.index, "text": "", "finish_reason": "", "logprobs": []}
        )
        choice["text"] += chunk.text
        choice["logprobs"] += [
            {
                "token": e.token,
                "token_id": e.token_id,
                "logprob": e.logprob,
                "bytes": list(e.bytes),
                "top": [(t.token, t.logprob) for t in e.top_logprobs],
            }
            for e in chunk.logprobs
        ]
        choice["finish_reason"] = chunk.finish_reason or choice["finish_reason"]
        if chunk.HasField("usage"):
            usage = {
                "prompt": chunk.usage.prompt_tokens,
                "completion": chunk.usage.completion_tokens,
            }
    for index, choice in sorted(choices.items()):
        print(f"choice {index} ({choice['finish_reason']}): {choice['text']!r}")
        for e in choice["logprobs"][:3]:
            print(f"  {e['token']!r} id={e['token_id']} logprob={e['logprob']:.4f} top={e['top']}")
    return {"choices": [choices[i] for i in sorted(choices)], "usage": usage}


def json_answer(stub: Any, pb: ModuleType, meta: list[Any]) -> Any:
    """Chat constrained to SCHEMA; the answer parsed as JSON."""
    constraint = pb.StructuredOutputs(json=json.dumps(SCHEMA))
    params = pb.TextSamplingParams(max_tokens=96, temperature=0, structured_outputs=constraint)
    turn = pb.ChatMessage(role="user", content="Name a big city and its country, as JSON.")
    reply = stub.Chat(pb.ChatRequest(messages=[turn], params=params), metadata=meta)
    print(f"json ({reply.finish_reason}): {reply.text}")
    return json.loads(reply.text)


def tool_call(stub: Any, pb: ModuleType, meta: list[Any]) -> dict[str, Any]:
    """Offer get_weather and force it; the parsed call."""
    tool = pb.Tool(
        name="get_weather",
        description="The weather in a city.",
        parameters=json.dumps(WEATHER_ARGS),
    )
    request = pb.ChatRequest(
        messages=[pb.ChatMessage(role="user", content="What is the weather in Paris?")],
        params=pb.TextSamplingParams(max_tokens=64, temperature=0),
        tools=[tool],
        tool_choice=pb.ToolChoice(function="get_weather"),
    )
    reply = stub.Chat(request, metadata=meta)
    (call,) = reply.choices[0].tool_calls
    print(f"tool call ({reply.finish_reason}): {call.name}({call.arguments}) id={call.id}")
    return {
        "id": call.id,
        "name": call.name,
        "arguments": json.loads(call.arguments),
        "finish_reason": reply.finish_reason,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gateway", default="127.0.0.1:50052")
    parser.add_argument("--api-key", default=os.environ.get("TESSERA_API_KEY", ""))
    parser.add_argument("--prompt", default="Tell me about Paris in one sentence.")
    args = parser.parse_args()
    pb, pb_grpc = load_stubs()
    meta = [("authorization", f"Bearer {args.api_key}")] if args.api_key else []
    with grpc.insecure_channel(args.gateway) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        summary = stream_two_choices(stub, pb, args.prompt, meta)
        summary["json"] = json_answer(stub, pb, meta)
        summary["tool_call"] = tool_call(stub, pb, meta)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
