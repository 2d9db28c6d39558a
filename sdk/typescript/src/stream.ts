// A streamed job: `for await (const chunk of client.inferStream(...))` yields the text as it is
// generated; once the loop ends, `result` holds the job's InferenceResult.
import type { InferenceResult, ToolCallDelta } from "./gen/expert/v1/common_pb.js";
import type { InferStreamResponse } from "./gen/expert/v1/inference_pb.js";
import { ExpertError } from "./errors.js";

export interface StreamChunk {
  /** New text of choice `choice` (empty on a restart). */
  text: string;
  choice: number;
  /** With tools the model may call: new pieces of the choice's calls (a call's first piece has its
   * id and name, the next ones pieces of its arguments); a call's markup is never `text`. */
  toolCalls: ToolCallDelta[];
  /** The job started over (its engine failed): discard the text received so far. */
  restarted: boolean;
}

export class InferStream implements AsyncIterable<StreamChunk> {
  /** The job's id, once the server has accepted it. */
  jobId: string | undefined;
  /** The job's result, once the stream has ended. */
  result: InferenceResult | undefined;
  private started = false;

  constructor(private readonly open: () => AsyncIterable<InferStreamResponse>) {}

  async *[Symbol.asyncIterator](): AsyncIterator<StreamChunk> {
    if (this.started) throw new Error("an InferStream can be iterated once");
    this.started = true;
    try {
      for await (const { event } of this.open()) {
        if (event.case === "submitted") this.jobId = event.value.jobId;
        else if (event.case === "delta") {
          const { text, index, toolCalls } = event.value;
          yield { text, choice: index, toolCalls, restarted: false };
        } else if (event.case === "restartedAttempt") yield { text: "", choice: 0, toolCalls: [], restarted: true };
        else if (event.case === "result") this.result = event.value;
      }
    } catch (error) {
      throw ExpertError.from(error);
    }
  }

  /** Every chunk's text (choice 0), then the result: the stream read to its end. */
  async collect(): Promise<{ text: string; result: InferenceResult | undefined }> {
    let text = "";
    for await (const chunk of this) {
      if (chunk.restarted) text = "";
      else if (chunk.choice === 0) text += chunk.text;
    }
    return { text, result: this.result };
  }
}
