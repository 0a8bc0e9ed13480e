// A Tessera client in Node.js: loads the repository's .proto files, streams a chat
// through the gateway's TextGeneration API and prints the scheduler's EngineCore info.
// Then, like examples/clients/python/client.py, it streams a chat with n=2 and per-token
// logprobs (each chunk names its choice in `index`), asks for an answer constrained to a
// JSON schema (params.structured_outputs.json) and forces a tool call (tools + tool_choice),
// printing the parsed call. The last line printed is a JSON summary of all of it.
//
//   node client.js [--gateway 127.0.0.1:50052] [--scheduler 127.0.0.1:50051] [--prompt "..."]
//                  [--api-key KEY] [--image PATH]
//
// --image sends a PNG, JPEG or WebP file with the prompt (a vision-language model must be
// served): the user turn becomes parts, [{text}, {image: {data, mime_type}}].
//
// The gateway's API key goes as `authorization: Bearer KEY` metadata (--api-key, or the
// TESSERA_API_KEY variable); the scheduler is internal and takes the internal token from
// TESSERA_INTERNAL_TOKEN (an environment variable, so `ps` does not show it).
"use strict";

const fs = require("fs");
const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTOS = path.resolve(__dirname, "../../../protos");

function parseArgs(argv) {
  const args = {
    gateway: "127.0.0.1:50052",
    scheduler: "127.0.0.1:50051",
    prompt: "What is the capital of France?",
    maxTokens: 32,
    apiKey: process.env.TESSERA_API_KEY || "",
  };
  for (let i = 0; i < argv.length; i += 2) {
    const key = argv[i].replace(/^--/, "").replace(/-([a-z])/g, (_, c) => c.toUpperCase());
    args[key] = key === "maxTokens" ? Number(argv[i + 1]) : argv[i + 1];
  }
  return args;
}

function loadPackage() {
  const definition = protoLoader.loadSync(["generate.proto", "engine.proto"], {
    includeDirs: [PROTOS],
    keepCase: true,
    longs: Number,
    enums: String,
    defaults: true,
  });
  return grpc.loadPackageDefinition(definition).tessera.v1;
}

function bearer(token) {
  const metadata = new grpc.Metadata();
  if (token) metadata.set("authorization", `Bearer ${token}`);
  return metadata;
}

const MIME_TYPES = { ".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp" };

function userTurn(prompt, imagePath) {
  if (!imagePath) return { role: "user", content: prompt };
  const image = {
    data: fs.readFileSync(imagePath),
    mime_type: MIME_TYPES[path.extname(imagePath).toLowerCase()] || "image/png",
  };
  return { role: "user", parts: [{ text: prompt }, { image }] };
}

function streamChat(pkg, address, prompt, maxTokens, apiKey, imagePath) {
  const client = new pkg.TextGeneration(address, grpc.credentials.createInsecure());
  const request = {
    messages: [userTurn(prompt, imagePath)],
    params: { max_tokens: maxTokens, temperature: 0 },
  };
  return new Promise((resolve, reject) => {
    let text = "";
    let finish = "";
    const call = client.ChatStream(request, bearer(apiKey));
    call.on("data", (chunk) => {
      text += chunk.text;
      process.stdout.write(chunk.text);
      if (chunk.finish_reason) finish = chunk.finish_reason;
    });
    call.on("error", reject);
    call.on("end", () => {
      process.stdout.write("\n");
      client.close();
      resolve({ text, finish });
    });
  });
}

// Unary and server-streaming calls as promises.
function unary(client, method, request, apiKey) {
  return new Promise((resolve, reject) => {
    client[method](request, bearer(apiKey), (err, reply) => (err ? reject(err) : resolve(reply)));
  });
}

function collect(client, method, request, apiKey) {
  return new Promise((resolve, reject) => {
    const chunks = [];
    const call = client[method](request, bearer(apiKey));
    call.on("data", (chunk) => chunks.push(chunk));
    call.on("error", reject);
    call.on("end", () => resolve(chunks));
  });
}

const SCHEMA = {
  type: "object",
  properties: { city: { type: "string", maxLength: 24 }, country: { type: "string", maxLength: 24 } },
  required: ["city", "country"],
  additionalProperties: false,
};
const WEATHER_ARGS = {
  type: "object",
  properties: { city: { type: "string", maxLength: 24 } },
  required: ["city"],
  additionalProperties: false,
};

// n=2 with logprobs: text, finish reason and logprobs per choice index; usage at the end.
async function twoChoices(client, apiKey) {
  const request = {
    messages: [{ role: "user", content: "Tell me about Paris in one sentence." }],
    params: { n: 2, max_tokens: 24, temperature: 0.8, seed: 1, logprobs: true, top_logprobs: 2 },
  };
  const choices = {};
  let usage = null;
  for (const chunk of await collect(client, "ChatStream", request, apiKey)) {
    const choice = (choices[chunk.index] ||= { index: chunk.index, text: "", finish_reason: "", logprobs: [] });
    choice.text += chunk.text;
    if (chunk.finish_reason) choice.finish_reason = chunk.finish_reason;
    for (const entry of chunk.logprobs) {
      choice.logprobs.push({
        token: entry.token,
        token_id: entry.token_id,
        logprob: entry.logprob,
        bytes: Array.from(entry.bytes),
        top: entry.top_logprobs.map((t) => [t.token, t.logprob]),
      });
    }
    if (chunk.usage) usage = chunk.usage;
  }
  for (const choice of Object.values(choices)) {
    console.log(`choice ${choice.index} (${choice.finish_reason}): ${JSON.stringify(choice.text)}`);
  }
  return { choices: Object.values(choices), usage };
}

async function jsonAnswer(client, apiKey) {
  const reply = await unary(client, "Chat", {
    messages: [{ role: "user", content: "Name a big city and its country, as JSON." }],
    params: { max_tokens: 96, temperature: 0, structured_outputs: { json: JSON.stringify(SCHEMA) } },
  }, apiKey);
  console.log(`json (${reply.finish_reason}): ${reply.text}`);
  return JSON.parse(reply.text);
}

async function toolCall(client, apiKey) {
  const reply = await unary(client, "Chat", {
    messages: [{ role: "user", content: "What is the weather in Paris?" }],
    params: { max_tokens: 64, temperature: 0 },
    tools: [{ name: "get_weather", description: "The weather in a city.", parameters: JSON.stringify(WEATHER_ARGS) }],
    tool_choice: { function: "get_weather" },
  }, apiKey);
  const [call] = reply.choices[0].tool_calls;
  console.log(`tool call (${reply.finish_reason}): ${call.name}(${call.arguments}) id=${call.id}`);
  return { id: call.id, name: call.name, arguments: JSON.parse(call.arguments), finish_reason: reply.finish_reason };
}

function serverInfo(pkg, address) {
  const client = new pkg.EngineCore(address, grpc.credentials.createInsecure());
  return new Promise((resolve, reject) => {
    client.GetServerInfo({}, bearer(process.env.TESSERA_INTERNAL_TOKEN), (err, info) => {
      client.close();
      if (err) reject(err);
      else resolve(info);
    });
  });
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const pkg = loadPackage();
  const { text, finish } = await streamChat(
    pkg, args.gateway, args.prompt, args.maxTokens, args.apiKey, args.image
  );
  const info = await serverInfo(pkg, args.scheduler);
  const client = new pkg.TextGeneration(args.gateway, grpc.credentials.createInsecure());
  const sampled = await twoChoices(client, args.apiKey);
  const json = await jsonAnswer(client, args.apiKey);
  const tool_call = await toolCall(client, args.apiKey);
  client.close();
  console.log(JSON.stringify({ answer: text, finish_reason: finish, server_info: info, ...sampled, json, tool_call }));
}

main().catch((err) => {
  console.error(`error: ${err.message}`);
  process.exit(1);
});
