package tessera.example;

import com.google.protobuf.util.JsonFormat;
import io.grpc.ManagedChannel;
import io.grpc.ManagedChannelBuilder;
import io.grpc.Metadata;
import io.grpc.stub.MetadataUtils;
import java.util.Iterator;
import java.util.Map;
import java.util.TreeMap;
import java.util.concurrent.TimeUnit;
import tessera.v1.Generate.ChatMessage;
import tessera.v1.Generate.ChatRequest;
import tessera.v1.Generate.GenerateChunk;
import tessera.v1.Generate.GenerateResponse;
import tessera.v1.Generate.StructuredOutputs;
import tessera.v1.Generate.TextSamplingParams;
import tessera.v1.Generate.TokenLogprob;
import tessera.v1.Generate.Tool;
import tessera.v1.Generate.ToolCall;
import tessera.v1.Generate.ToolChoice;
import tessera.v1.TextGenerationGrpc;

/**
 * A Tessera client in Java over the gateway's public gRPC API (tessera.v1.TextGeneration), doing
 * what examples/clients/python/client.py does: a chat streamed with n=2 and per-token logprobs, an
 * answer constrained to a JSON schema, and a forced tool call. The last line printed is a JSON
 * summary.
 *
 * <pre>java -jar target/tessera-client.jar [--gateway 127.0.0.1:50052] [--api-key KEY]</pre>
 */
public final class Client {
  static final String SCHEMA =
      "{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\",\"maxLength\":24},"
          + "\"country\":{\"type\":\"string\",\"maxLength\":24}},\"required\":[\"city\",\"country\"],"
          + "\"additionalProperties\":false}";
  static final String WEATHER_ARGS =
      "{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\",\"maxLength\":24}},"
          + "\"required\":[\"city\"],\"additionalProperties\":false}";

  private Client() {}

  public static void main(String[] args) throws Exception {
    String gateway = "127.0.0.1:50052";
    String apiKey = System.getenv().getOrDefault("TESSERA_API_KEY", "");
    for (int i = 0; i + 1 < args.length; i += 2) {
      if (args[i].equals("--gateway")) gateway = args[i + 1];
      if (args[i].equals("--api-key")) apiKey = args[i + 1];
    }
    ManagedChannel channel = ManagedChannelBuilder.forTarget(gateway).usePlaintext().build();
    try {
      TextGenerationGrpc.TextGenerationBlockingStub stub = TextGenerationGrpc.newBlockingStub(channel);
      if (!apiKey.isEmpty()) {
        Metadata metadata = new Metadata();
        metadata.put(Metadata.Key.of("authorization", Metadata.ASCII_STRING_MARSHALLER), "Bearer " + apiKey);
        stub = stub.withInterceptors(MetadataUtils.newAttachHeadersInterceptor(metadata));
      }
      String choices = twoChoices(stub);
      String json = jsonAnswer(stub);
      String tool = toolCall(stub);
      System.out.println("{\"choices\":" + choices + ",\"json\":" + json + ",\"tool_call\":" + tool + "}");
    } finally {
      channel.shutdown().awaitTermination(5, TimeUnit.SECONDS);
    }
  }

  static ChatRequest.Builder chat(String content) {
    return ChatRequest.newBuilder().addMessages(ChatMessage.newBuilder().setRole("user").setContent(content));
  }

  /** ChatStream with n=2 and logprobs: the choices as a JSON array. */
  static String twoChoices(TextGenerationGrpc.TextGenerationBlockingStub stub) {
    TextSamplingParams params = TextSamplingParams.newBuilder().setN(2).setMaxTokens(24)
        .setTemperature(0.8).setSeed(1).setLogprobs(true).setTopLogprobs(2).build();
    Map<Integer, StringBuilder> texts = new TreeMap<>();
    Map<Integer, String> finish = new TreeMap<>();
    Map<Integer, StringBuilder> logprobs = new TreeMap<>();
    Iterator<GenerateChunk> chunks = stub.chatStream(chat("Tell me about Paris in one sentence.").setParams(params).build());
    while (chunks.hasNext()) {
      GenerateChunk chunk = chunks.next();
      texts.computeIfAbsent(chunk.getIndex(), k -> new StringBuilder()).append(chunk.getText());
      if (!chunk.getFinishReason().isEmpty()) finish.put(chunk.getIndex(), chunk.getFinishReason());
      StringBuilder lps = logprobs.computeIfAbsent(chunk.getIndex(), k -> new StringBuilder());
      for (TokenLogprob entry : chunk.getLogprobsList()) {
        if (lps.length() > 0) lps.append(',');
        lps.append(printJson(entry));
      }
    }
    StringBuilder out = new StringBuilder("[");
    for (Map.Entry<Integer, StringBuilder> e : texts.entrySet()) {
      int index = e.getKey();
      System.out.println("choice " + index + " (" + finish.get(index) + "): " + e.getValue());
      if (out.length() > 1) out.append(',');
      out.append("{\"index\":").append(index).append(",\"text\":").append(quote(e.getValue().toString()))
          .append(",\"finish_reason\":").append(quote(finish.getOrDefault(index, "")))
          .append(",\"logprobs\":[").append(logprobs.get(index)).append("]}");
    }
    return out.append(']').toString();
  }

  /** Chat constrained to SCHEMA: the answer, which is JSON. */
  static String jsonAnswer(TextGenerationGrpc.TextGenerationBlockingStub stub) {
    TextSamplingParams params = TextSamplingParams.newBuilder().setMaxTokens(96).setTemperature(0)
        .setStructuredOutputs(StructuredOutputs.newBuilder().setJson(SCHEMA)).build();
    GenerateResponse reply = stub.chat(chat("Name a big city and its country, as JSON.").setParams(params).build());
    System.out.println("json (" + reply.getFinishReason() + "): " + reply.getText());
    return reply.getText();
  }

  /** get_weather offered and forced: the parsed call as JSON. */
  static String toolCall(TextGenerationGrpc.TextGenerationBlockingStub stub) {
    Tool tool = Tool.newBuilder().setName("get_weather").setDescription("The weather in a city.")
        .setParameters(WEATHER_ARGS).build();
    ChatRequest request = chat("What is the weather in Paris?")
        .setParams(TextSamplingParams.newBuilder().setMaxTokens(64).setTemperature(0))
        .addTools(tool).setToolChoice(ToolChoice.newBuilder().setFunction("get_weather")).build();
    GenerateResponse reply = stub.chat(request);
    ToolCall call = reply.getChoices(0).getToolCalls(0);
    System.out.println("tool call (" + reply.getFinishReason() + "): " + call.getName() + "(" + call.getArguments() + ")");
    return "{\"id\":" + quote(call.getId()) + ",\"name\":" + quote(call.getName()) + ",\"arguments\":"
        + call.getArguments() + ",\"finish_reason\":" + quote(reply.getFinishReason()) + "}";
  }

  static String printJson(TokenLogprob entry) {
    try {
      return JsonFormat.printer().preservingProtoFieldNames().omittingInsignificantWhitespace().print(entry);
    } catch (com.google.protobuf.InvalidProtocolBufferException e) {
      throw new IllegalStateException(e);
    }
  }

  static String quote(String s) {
    StringBuilder out = new StringBuilder("\"");
    for (char c : s.toCharArray()) {
      if (c == '"' || c == '\\') out.append('\\').append(c);
      else if (c < 0x20) out.append(String.format("\\u%04x", (int) c));
      else out.append(c);
    }
    return out.append('"').toString();
  }
}
