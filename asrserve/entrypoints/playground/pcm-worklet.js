// Audio-thread half of the playground's live capture: the microphone's float samples as
// 16-bit PCM (little-endian, as every browser's typed arrays are) at the target rate, posted to
// the page in 100 ms chunks, the size OpenAI's examples append.
"use strict";

class PCM16Capture extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const targetRate = options.processorOptions.targetRate;
    this.step = sampleRate / targetRate; // input samples per output sample (`sampleRate`: the context's)
    this.position = 0; // where the next output sample lies, 0 being the previous block's last input
    this.previous = 0; // that last input sample
    this.chunkSize = Math.round(targetRate / 10);
    this.chunk = new Int16Array(this.chunkSize);
    this.filled = 0;
  }

  push(sample) {
    const clipped = Math.max(-1, Math.min(1, sample));
    this.chunk[this.filled++] = Math.round(clipped * 32767);
    if (this.filled === this.chunkSize) {
      this.port.postMessage(this.chunk.buffer, [this.chunk.buffer]); // moved, not copied: chunk is now empty
      this.chunk = new Int16Array(this.chunkSize);
      this.filled = 0;
    }
  }

  process(inputs) {
    const input = inputs[0][0]; // mono: the first channel
    if (!input) return true;
    if (this.step === 1) {
      for (const sample of input) this.push(sample);
      return true;
    }
    // Only where the browser could not capture at the target rate itself: linear interpolation.
    while (this.position < input.length) {
      const index = Math.floor(this.position);
      const fraction = this.position - index;
      const before = index === 0 ? this.previous : input[index - 1];
      this.push(before + (input[index] - before) * fraction);
      this.position += this.step;
    }
    this.position -= input.length;
    this.previous = input[input.length - 1];
    return true;
  }
}

registerProcessor("pcm16-capture", PCM16Capture);
