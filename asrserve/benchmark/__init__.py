"""`asrserve bench`: a load generator for a running OpenAI-compatible speech-to-text server."""
