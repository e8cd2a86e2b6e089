"""The wire formats of the OpenAI API: `protocol` (request models, the error format, a request's engine options),
`openai_format` (chat and completion bodies, SSE chunks), `responses_protocol` + `responses_format` (the Responses
API's request and its objects)."""
