// A Tessera client in Node.js: loads the repository's .proto files, streams a chat
// through the gateway's TextGeneration API and prints the scheduler's EngineCore info.
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
  console.log(JSON.stringify({ answer: text, finish_reason: finish, server_info: info }));
}

main().catch((err) => {
  console.error(`error: ${err.message}`);
  process.exit(1);
});
