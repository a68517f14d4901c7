// The Vercel AI SDK (`ai` with its OpenAI-compatible, OpenAI and Anthropic providers) as a client
// of pdserve, run by tests/frontend/test_ai_sdk_e2e.py: `node client.mjs BASE_URL MODEL API_KEY`.
//
// Each scenario is a call an agent app makes (text, tool calls, a tool loop, objects, an agent
// with tools and a typed answer; chat, the Responses API and the Messages API, streamed or not,
// greedy). It prints, as one JSON list, what the SDK made of each step and the request bodies
// the SDK sent, which the test replays to compare with the server's own answer. Every request
// gets its own `cache_salt` (the SDK's body is otherwise unchanged): nothing comes from the
// prefix cache, so the replay computes exactly what the SDK's request did.
import { Output, generateObject, generateText, stepCountIs, streamObject, streamText, tool } from 'ai';
import { createAnthropic } from '@ai-sdk/anthropic';
import { createOpenAI } from '@ai-sdk/openai';
import { createOpenAICompatible } from '@ai-sdk/openai-compatible';
import { z } from 'zod';

const [baseURL, model, apiKey] = process.argv.slice(2);
let requests = [];  // the running scenario's requests, in the order the SDK sent them
let salts = 0;

async function recordingFetch(url, init) {
  const body = JSON.parse(init.body);
  body.cache_salt = `ai-sdk-${process.pid}-${salts++}`;
  requests.push({ path: new URL(url).pathname, body });
  return fetch(url, { ...init, body: JSON.stringify(body) });
}

const compat = createOpenAICompatible({ name: 'pdserve', baseURL, apiKey, includeUsage: true,
                                        supportsStructuredOutputs: true, fetch: recordingFetch });
const openai = createOpenAI({ baseURL, apiKey, fetch: recordingFetch });
const anthropic = createAnthropic({ baseURL, apiKey, fetch: recordingFetch });

const weather = tool({
  description: 'The weather in a city',
  inputSchema: z.object({ city: z.string() }),
  execute: async ({ city }) => ({ city, celsius: 21 }),
});
const person = z.object({ name: z.string(), age: z.number().int() });
const report = z.object({ city: z.string().max(20), summary: z.string().max(40) });
const callThenAnswer = ({ stepNumber }) => ({ toolChoice: stepNumber === 0 ? 'required' : 'none' });

function stepOf(s) {
  return { text: s.text, finishReason: s.finishReason,
           toolCalls: s.toolCalls.map((c) => ({ name: c.toolName, input: c.input })),
           usage: { input: s.usage.inputTokens, output: s.usage.outputTokens } };
}

// A streamed result: its steps, and what the stream parts carried (text, each call's input deltas).
async function streamed(result) {
  const parts = { text: '', toolInput: {}, types: [] };
  for await (const p of result.fullStream) {
    parts.types.push(p.type);
    if (p.type === 'text-delta') parts.text += p.text;
    if (p.type === 'tool-input-delta') parts.toolInput[p.id] = (parts.toolInput[p.id] ?? '') + p.delta;
    if (p.type === 'error') throw p.error;
  }
  return { steps: (await result.steps).map(stepOf), parts };
}

const scenarios = {
  'chat text': async () => ({ steps: (await generateText({
    model: compat(model), prompt: 'Say hello.', maxOutputTokens: 8, temperature: 0 })).steps.map(stepOf) }),
  'chat text streamed': async () => streamed(streamText({
    model: compat(model), system: 'Answer briefly.', prompt: 'Name a color.', maxOutputTokens: 12, temperature: 0 })),
  'chat tool call streamed': async () => streamed(streamText({
    model: compat(model), prompt: 'What is the weather in Paris?', tools: { weather }, toolChoice: 'required',
    maxOutputTokens: 40, temperature: 0 })),
  'chat tool call streamed, OpenAI provider': async () => streamed(streamText({
    model: openai.chat(model), prompt: 'What is the weather in Rome?', tools: { weather }, toolChoice: 'required',
    maxOutputTokens: 40, temperature: 0 })),
  'chat tool loop': async () => ({ steps: (await generateText({
    model: compat(model), prompt: 'What is the weather in Paris?', tools: { weather }, prepareStep: callThenAnswer,
    stopWhen: stepCountIs(2), maxOutputTokens: 24, temperature: 0 })).steps.map(stepOf) }),
  'chat object': async () => {
    const r = await generateObject({ model: compat(model), prompt: 'Describe a person.', schema: person,
                                     maxOutputTokens: 60, temperature: 0 });
    return { object: r.object, steps: [] };
  },
  'chat object streamed': async () => {
    const r = streamObject({ model: compat(model), prompt: 'Describe a famous person.', schema: person,
                             maxOutputTokens: 60, temperature: 0 });
    for await (const _ of r.partialObjectStream) { /* the partial objects */ }
    return { object: await r.object, steps: [] };
  },
  // an agent with tools and a typed answer: tools and a response_format in every step, no tool_choice
  'chat agent with an output object': async () => {
    const r = await generateText({ model: compat(model), prompt: 'What is the weather in Paris?', tools: { weather },
                                   output: Output.object({ schema: report }), stopWhen: stepCountIs(3),
                                   maxOutputTokens: 60, temperature: 0 });
    return { object: r.output, steps: r.steps.map(stepOf) };
  },
  'responses agent with an output object streamed': async () => {
    const r = streamText({ model: openai.responses(model), prompt: 'What is the weather in Paris?', tools: { weather },
                           output: Output.object({ schema: report }), stopWhen: stepCountIs(3),
                           maxOutputTokens: 60, temperature: 0 });
    const s = await streamed(r);
    return { object: await r.output, ...s };
  },
  'responses text': async () => ({ steps: (await generateText({
    model: openai.responses(model), prompt: 'Say hello.', maxOutputTokens: 16, temperature: 0 })).steps.map(stepOf) }),
  'responses tool loop streamed': async () => streamed(streamText({
    model: openai.responses(model), prompt: 'What is the weather in Oslo?', tools: { weather },
    prepareStep: callThenAnswer, stopWhen: stepCountIs(2), maxOutputTokens: 24, temperature: 0 })),
  'responses object': async () => {
    const r = await generateObject({ model: openai.responses(model), prompt: 'Describe a person.', schema: person,
                                     maxOutputTokens: 60, temperature: 0 });
    return { object: r.object, steps: [] };
  },
  'messages text streamed': async () => streamed(streamText({
    model: anthropic(model), system: 'Answer briefly.', prompt: 'Name a fruit.', maxOutputTokens: 12, temperature: 0 })),
  'messages tool loop streamed': async () => streamed(streamText({
    model: anthropic(model), prompt: 'What is the weather in Lima?', tools: { weather },
    prepareStep: callThenAnswer, stopWhen: stepCountIs(2), maxOutputTokens: 24, temperature: 0 })),
  'messages object': async () => {
    const r = await generateObject({ model: anthropic(model), prompt: 'Describe a person.', schema: person,
                                     maxOutputTokens: 60, temperature: 0 });
    return { object: r.object, steps: [] };
  },
  'refusals': async () => {
    // a request over the context: the SDK raises the server's 400 with its message, streamed or not
    const refusals = [];
    for (const provider of [compat(model), openai.chat(model), openai.responses(model), anthropic(model)]) {
      for (const stream of [false, true]) {
        const ask = { model: provider, prompt: 'Say hello.', maxOutputTokens: 100000, maxRetries: 0 };
        try {
          if (stream) {
            for await (const p of streamText({ ...ask, onError: () => {} }).fullStream) if (p.type === 'error') throw p.error;
          } else {
            await generateText(ask);
          }
          refusals.push({ stream, status: null, message: null });
        } catch (e) {
          refusals.push({ stream, status: e.statusCode ?? null, message: e.message });
        }
      }
    }
    return { refusals, steps: [] };
  },
};

const out = [];
for (const [name, run] of Object.entries(scenarios)) {
  requests = [];
  try {
    out.push({ name, ...(await run()), requests });
  } catch (e) {
    out.push({ name, error: `${e.constructor.name}: ${e.message} ${e.responseBody ?? ''}`, requests });
  }
}
console.log(JSON.stringify(out));
