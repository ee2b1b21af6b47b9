// server_test.mjs -- examples/server.c driven by real clients: the official
// `openai` npm package (chat and completions, streaming and not), curl, raw
// sockets for malformed HTTP, and a bounded load run of concurrent streaming
// clients, some of which disconnect midway.
//
//   node tests/server/server_test.mjs SERVER_BINARY MODEL_DIR
//
// Needs the `openai` package where Node can find it (NODE_PATH; .ci/run and
// tests/run.sh install it into build/npm).  Talks only to 127.0.0.1.  Ends
// with "server: N passed, N failed".
import { spawn, execFile } from 'node:child_process';
import net from 'node:net';
import path from 'node:path';
import fs from 'node:fs';
import { createRequire } from 'node:module';
const require = createRequire(process.env.NODE_PATH ? path.resolve(process.env.NODE_PATH) + '/' : import.meta.url);
const OpenAI = require('openai').default ?? require('openai');

const [bin, modelDir] = process.argv.slice(2);
let passed = 0, failed = 0;
const check = (ok, what) => { if (ok) passed++; else { failed++; console.log('  FAIL ' + what); } };
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const deadline = Date.now() + 240_000;   // the whole run is bounded

// ---- the server ----
const MAX_CONNS = 80, MAX_BODY = 65536, MAX_HEADER = 8192;
const srv = spawn(bin, ['-m', modelDir, '--port', '0', '--alias', 'test-model', '--max-conns', String(MAX_CONNS),
                        '--max-body', String(MAX_BODY), '--max-header', String(MAX_HEADER), '--timeout', '20'],
                  { stdio: ['ignore', 'pipe', 'inherit'] });
const port = await new Promise((resolve, reject) => {
  let out = '';
  srv.stdout.on('data', (d) => {
    out += d;
    const m = out.match(/listening on http:\/\/127\.0\.0\.1:(\d+)/);
    if (m) resolve(Number(m[1]));
  });
  srv.on('exit', (code) => reject(new Error('server exited with ' + code + ': ' + out)));
  setTimeout(() => reject(new Error('server did not start: ' + out)), 60_000);
});
const base = `http://127.0.0.1:${port}`;
console.log('server on ' + base);
const client = new OpenAI({ baseURL: base + '/v1', apiKey: 'unused', maxRetries: 0, timeout: 60_000 });

const raw = (bytes, wait = 3000) => new Promise((resolve) => {
  const s = net.connect(port, '127.0.0.1');
  let got = '';
  s.on('data', (d) => { got += d; });
  s.on('close', () => resolve(got));
  s.on('error', () => resolve(got));
  s.write(bytes);
  setTimeout(() => { s.destroy(); resolve(got); }, wait);
});
const metrics = async () => {
  const got = await raw('GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n', 10_000);
  const text = got.slice(got.indexOf('\r\n\r\n') + 4);
  const get = (name) => { const m = text.match(new RegExp('^' + name.replace(/[{}"=.]/g, (c) => '\\' + c) + ' ([0-9.eE+-]+)$', 'm')); return m ? Number(m[1]) : NaN; };
  return { text, get };
};
const curl = (args, input) => new Promise((resolve) => {
  const p = execFile('curl', ['-s', '-S', '--max-time', '30', ...args], { maxBuffer: 1 << 24 }, (err, stdout, stderr) =>
    resolve({ err, stdout, stderr }));
  if (input !== undefined) { p.stdin.write(input); p.stdin.end(); }
});
const curlStatus = async (args, input) => {
  const r = await curl(['-o', '-', '-w', '\n%{http_code}', ...args], input);
  const i = r.stdout.lastIndexOf('\n');
  return { code: Number(r.stdout.slice(i + 1)), body: r.stdout.slice(0, i) };
};
// Resident memory in three parts: the engine's KV pool (one anonymous
// mapping sized at engine creation, whose pages are touched as blocks are
// first used; it never grows), files mapped read-only (the weights, whose
// pages come in as rows are first read, and the program), and the rest:
// heap, stacks and every other anonymous page, which must come back
const memory = (poolBytes) => {
  let text;
  try { text = fs.readFileSync(`/proc/${srv.pid}/smaps`, 'utf8'); } catch { return null; }
  let total = 0, pool = 0, files = 0, size = 0, file = false;
  for (const l of text.split('\n')) {
    const h = l.match(/^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$/);
    if (h) { size = parseInt(h[2], 16) - parseInt(h[1], 16); file = h[3].startsWith('/'); continue; }
    const r = l.match(/^Rss:\s+(\d+) kB/);
    if (!r) continue;
    const b = +r[1] * 1024;
    total += b;
    if (file) files += b;
    // the pool is madvised for huge pages: the kernel splits its mapping at
    // 2 MiB boundaries, so its biggest part may be up to 4 MiB smaller
    else if (size >= poolBytes - 4 * 1048576 && size < poolBytes + 8 * 1048576 && b > pool) { total -= 0; pool = b; }
  }
  return { total, pool, files, other: total - pool - files };
};
const errorBody = (body) => { try { const e = JSON.parse(body).error; return e && typeof e.message === 'string' && typeof e.type === 'string'; } catch { return false; } };

try {
  // ---- the openai client: models, chat, completions ----
  const models = await client.models.list();
  check(models.data.length === 1 && models.data[0].id === 'test-model', 'models.list: ' + JSON.stringify(models.data));

  const messages = [{ role: 'system', content: 'You are a poet.' }, { role: 'user', content: 'Speak of the moon.' }];
  const chat = await client.chat.completions.create({ model: 'test-model', messages, max_tokens: 24, temperature: 0 });
  const c0 = chat.choices[0];
  check(chat.object === 'chat.completion' && c0.message.role === 'assistant' && typeof c0.message.content === 'string' &&
        c0.message.content.length > 0, 'chat non-streaming: ' + JSON.stringify(chat));
  check(['length', 'stop'].includes(c0.finish_reason) && chat.usage.completion_tokens > 0 && chat.usage.prompt_tokens > 0 &&
        chat.usage.total_tokens === chat.usage.prompt_tokens + chat.usage.completion_tokens, 'chat usage: ' + JSON.stringify(chat.usage));
  const stream = await client.chat.completions.create({ model: 'test-model', messages, max_tokens: 24, temperature: 0, stream: true,
                                                        stream_options: { include_usage: true } });
  let streamed = '', finish = null, chunks = 0, role = null, usage = null;
  for await (const ch of stream) {
    chunks++;
    if (ch.usage) usage = ch.usage;
    const d = ch.choices[0]?.delta;
    if (d?.role) role = d.role;
    if (d?.content) streamed += d.content;
    if (ch.choices[0]?.finish_reason) finish = ch.choices[0].finish_reason;
  }
  check(streamed === c0.message.content && finish === c0.finish_reason && role === 'assistant' && chunks > 2,
        `chat streaming = non-streaming: ${JSON.stringify(streamed)} vs ${JSON.stringify(c0.message.content)}, ${finish}, ${chunks} chunks`);
  check(usage && usage.completion_tokens === chat.usage.completion_tokens, 'stream usage: ' + JSON.stringify(usage));

  // seeded sampling: the same seed, the same text, streamed or not
  const sampled = { model: 'test-model', prompt: 'ROMEO:', max_tokens: 32, temperature: 0.8, top_p: 0.95, seed: 7 };
  const s1 = await client.completions.create(sampled), s2 = await client.completions.create(sampled);
  check(s1.choices[0].text === s2.choices[0].text && s1.choices[0].text.length > 0, 'seeded completions repeat');
  let s3 = '';
  for await (const ch of await client.completions.create({ ...sampled, stream: true })) s3 += ch.choices[0]?.text ?? '';
  check(s3 === s1.choices[0].text, `streamed completion = non-streamed: ${JSON.stringify(s3)} vs ${JSON.stringify(s1.choices[0].text)}`);
  const other = await client.completions.create({ ...sampled, seed: 8 });
  check(other.choices[0].text !== s1.choices[0].text, 'another seed, another text');

  // stop sequences cut the text before the first one, streamed or not
  const full = (await client.completions.create({ model: 'test-model', prompt: 'ROMEO:', max_tokens: 48, temperature: 0 })).choices[0].text;
  const stopAt = full.slice(12, 15);
  const want = full.slice(0, full.indexOf(stopAt));
  const st = await client.completions.create({ model: 'test-model', prompt: 'ROMEO:', max_tokens: 48, temperature: 0, stop: [stopAt, 'zzzz'] });
  check(st.choices[0].text === want && st.choices[0].finish_reason === 'stop',
        `stop ${JSON.stringify(stopAt)}: ${JSON.stringify(st.choices[0].text)} want ${JSON.stringify(want)}`);
  let sst = '', sfin = null;
  for await (const ch of await client.completions.create({ model: 'test-model', prompt: 'ROMEO:', max_tokens: 48, temperature: 0, stop: stopAt, stream: true })) {
    sst += ch.choices[0]?.text ?? '';
    if (ch.choices[0]?.finish_reason) sfin = ch.choices[0].finish_reason;
  }
  check(sst === want && sfin === 'stop', `streamed stop: ${JSON.stringify(sst)} ${sfin}`);

  // errors come back as OpenAI errors
  for (const [what, body] of [['n=2', { n: 2 }], ['temperature 3', { temperature: 3 }], ['max_tokens 0', { max_tokens: 0 }],
                              ['stop of 5', { stop: ['a', 'b', 'c', 'd', 'e'] }], ['bad role', { messages: [{ role: 'robot', content: 'x' }] }]]) {
    try {
      await client.chat.completions.create({ model: 'test-model', messages, max_tokens: 4, ...body });
      check(false, what + ' must fail');
    } catch (e) {
      check(e.status === 400 && typeof e.message === 'string' && e.error?.type === 'invalid_request_error', `${what}: ${e.status} ${e.message}`);
    }
  }

  // ---- curl ----
  let r = await curlStatus([base + '/health']);
  check(r.code === 200 && JSON.parse(r.body).status === 'ok', 'curl /health: ' + r.code + ' ' + r.body);
  r = await curlStatus([base + '/v1/chat/completions', '-H', 'Content-Type: application/json', '-d',
                        JSON.stringify({ messages, max_tokens: 24, temperature: 0 })]);
  check(r.code === 200 && JSON.parse(r.body).choices[0].message.content === c0.message.content, 'curl chat = openai chat');
  r = await curlStatus(['-N', base + '/v1/chat/completions', '-d', JSON.stringify({ messages, max_tokens: 24, temperature: 0, stream: true })]);
  const sse = r.body.split('\n\n').filter((l) => l.startsWith('data: '));
  check(r.code === 200 && sse[sse.length - 1] === 'data: [DONE]' &&
        sse.slice(0, -1).map((l) => JSON.parse(l.slice(6)).choices[0].delta.content ?? '').join('') === c0.message.content,
        'curl SSE stream: ' + sse.length + ' events');
  r = await curlStatus([base + '/v1/completions', '-H', 'Transfer-Encoding: chunked', '--data-binary', '@-'],
                       JSON.stringify({ prompt: 'ROMEO:', max_tokens: 48, temperature: 0 }));
  check(r.code === 200 && JSON.parse(r.body).choices[0].text === full, 'curl chunked request body: ' + r.code);
  r = await curlStatus([base + '/v1/chat/completions', '-d', '{"messages": [}']);
  check(r.code === 400 && errorBody(r.body) && /malformed JSON/.test(r.body), 'malformed JSON: ' + r.code + ' ' + r.body);
  r = await curlStatus([base + '/v1/chat/completions', '-d', '[1, 2]']);
  check(r.code === 400 && errorBody(r.body), 'a JSON array body: ' + r.code);
  r = await curlStatus([base + '/v1/chat/completions', '-d', '{"messages": "hi"}']);
  check(r.code === 400 && JSON.parse(r.body).error.param === 'messages', 'messages not a list: ' + r.body);
  r = await curlStatus([base + '/v1/completions', '--data-binary', '@-'], JSON.stringify({ prompt: 'x'.repeat(MAX_BODY) }));
  check(r.code === 413 && errorBody(r.body), 'body over --max-body: ' + r.code);
  r = await curlStatus([base + '/health', '-H', 'X-Big: ' + 'y'.repeat(MAX_HEADER)]);
  check(r.code === 431 && errorBody(r.body), 'header over --max-header: ' + r.code);
  r = await curlStatus([base + '/v2/nothing']);
  check(r.code === 404 && errorBody(r.body), 'unknown route: ' + r.code);
  r = await curlStatus([base + '/v1/completions']);
  check(r.code === 405 && errorBody(r.body), 'GET on a POST route: ' + r.code);
  r = await curlStatus(['-X', 'POST', '-H', 'Content-Length:', base + '/v1/completions']);
  check(r.code === 411 || r.code === 400, 'POST without a length: ' + r.code);
  r = await curlStatus([base + '/metrics']);
  check(r.code === 200 && /^cm384_requests_total\{state="done"\} \d+$/m.test(r.body) && /^cm384_ttft_milliseconds\{quantile="0.99"\}/m.test(r.body) &&
        /^cm384_fabric_bytes_total\{plane="ub",kind="dispatch"\} \d+$/m.test(r.body) && /^cm384_fabric_bytes_total\{plane="rdma",kind="kv_handoff"\} \d+$/m.test(r.body) &&
        /^cm384_expert_tokens_total\{expert="0"\} \d+$/m.test(r.body) && /^cm384_cache_hit_ratio /m.test(r.body), 'curl /metrics');
  const types = r.body.split('\n').filter((l) => l.startsWith('# TYPE')).length;
  check(r.body.split('\n').filter((l) => l && !l.startsWith('#')).every((l) => /^[a-z_0-9]+(\{[^}]*\})? -?[0-9.eE+-]+$/.test(l)) && types > 10,
        'every /metrics line is a Prometheus sample');

  // ---- malformed HTTP on raw sockets ----
  for (const [what, req, code] of [
    ['garbage request line', 'HELLO\r\n\r\n', 400], ['lower-case method', 'get /health HTTP/1.1\r\n\r\n', 400],
    ['HTTP/2.0', 'GET /health HTTP/2.0\r\n\r\n', 505], ['header without colon', 'GET /health HTTP/1.1\r\nBad header\r\n\r\n', 400],
    ['bad Content-Length', 'POST /v1/completions HTTP/1.1\r\nContent-Length: 12x\r\n\r\n', 400],
    ['two lengths', 'POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}', 400],
    ['gzip transfer coding', 'POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n', 501],
    ['bad chunk', 'POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n', 400],
    ['no blank line, too long', 'GET /health HTTP/1.1\r\n' + 'X: y\r\n'.repeat(2000), 431],
  ]) {
    const got = await raw(req);
    const m = got.match(/^HTTP\/1\.1 (\d+)/);
    check(m && Number(m[1]) === code && errorBody(got.slice(got.indexOf('\r\n\r\n') + 4)), `${what}: ${JSON.stringify(got.slice(0, 60))}`);
  }
  // two requests pipelined on one connection, both answered
  const two = await raw('GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n');
  check((two.match(/HTTP\/1\.1 200/g) || []).length === 2, 'pipelined requests: ' + JSON.stringify(two.slice(0, 80)));

  // ---- connection limit ----
  // MAX_CONNS + 5 idle connections: whatever else is open, at least 5 are
  // refused with a 503 and an error body, and counted
  const m0 = await metrics();
  const before = m0.get('cm384_server_connections_total{state="refused"}'), open0 = m0.get('cm384_server_connections');
  const idle = [], answers = [];
  for (let i = 0; i < MAX_CONNS + 5; i++) {
    const s = net.connect(port, '127.0.0.1');
    answers.push('');
    s.on('data', (d) => { answers[i] += d; });
    s.on('error', () => {});
    idle.push(s);
  }
  for (let i = 0; i < 50 && answers.filter((a) => a).length < 5; i++) await sleep(100);
  const refused = answers.filter((a) => a);
  check(refused.length >= 5 && refused.every((a) => /^HTTP\/1\.1 503/.test(a) && errorBody(a.slice(a.indexOf('\r\n\r\n') + 4))),
        `connections over --max-conns: ${refused.length} answered, ${JSON.stringify(refused[0]?.slice(0, 40))}`);
  idle.forEach((s) => s.destroy());
  for (let i = 0; i < 50 && (await metrics()).get('cm384_server_connections') > open0; i++) await sleep(100);
  const m1 = await metrics();
  check(m1.get('cm384_server_connections_total{state="refused"}') === before + refused.length && m1.get('cm384_server_connections') <= open0,
        `refused count and open connections after the limit test: refused ${before} -> ${m1.get('cm384_server_connections_total{state="refused"}')} (${refused.length} seen), open ${open0} -> ${m1.get('cm384_server_connections')}`);

  // ---- a client that disconnects cancels its request ----
  const cancelledBefore = m1.get('cm384_requests_total{state="cancelled"}');
  const ac = new AbortController();
  const long = await client.chat.completions.create({ model: 'test-model', messages, max_tokens: 900, temperature: 0.8, seed: 1, stream: true },
                                                     { signal: ac.signal });
  let got = 0;
  try { for await (const ch of long) { if (ch.choices[0]?.delta?.content && ++got === 3) ac.abort(); } } catch { /* aborted */ }
  let m2;
  for (let i = 0; i < 100; i++) {
    m2 = await metrics();
    if (m2.get('cm384_requests_total{state="cancelled"}') > cancelledBefore) break;
    await sleep(50);
  }
  check(m2.get('cm384_requests_total{state="cancelled"}') === cancelledBefore + 1 && m2.get('cm384_tokens_total{kind="decoded"}') < m1.get('cm384_tokens_total{kind="decoded"}') + 900,
        'disconnect cancels: cancelled ' + cancelledBefore + ' -> ' + m2.get('cm384_requests_total{state="cancelled"}'));

  // ---- load run ----
  // 16 distinct requests, each alone first (the reference), then 64 clients
  // at once (4 per request), every 4th client disconnecting after its first
  // chunk -- not a later one: the server sends what accumulated since its
  // last write, so how many chunks a stream takes depends on timing, and a
  // fast stream can end in fewer than 3
  // SERVER_TEST_TSAN=1: a smaller run, and no memory figures (ThreadSanitizer's
  // shadow memory is in them)
  const TSAN = !!process.env.SERVER_TEST_TSAN;
  const N = TSAN ? 16 : 64, DISTINCT = TSAN ? 8 : 16, MAXTOK = 48;
  const prompts = ['ROMEO:', 'JULIET:', 'First Citizen:', 'KING RICHARD III:', 'What light', 'O, ', 'To be', 'My lord,'];
  const reqOf = (k) => ({ model: 'test-model', messages: [{ role: 'user', content: prompts[k % prompts.length] + ' #' + k }],
                          max_tokens: MAXTOK, temperature: k % 3 === 0 ? 0 : 0.9, top_p: 0.95, seed: 100 + k, stream: true });
  const runOne = async (k, abortAfter) => {
    const t0 = performance.now();
    const ac2 = new AbortController();
    let text = '', fin = null, ttft = null, n = 0, aborted = false;
    try {
      const s = await client.chat.completions.create(reqOf(k), { signal: ac2.signal });
      for await (const ch of s) {
        const d = ch.choices[0]?.delta?.content;
        if (d) { if (ttft === null) ttft = performance.now() - t0; text += d; if (++n === abortAfter) { aborted = true; ac2.abort(); } }
        if (ch.choices[0]?.finish_reason) fin = ch.choices[0].finish_reason;
      }
    } catch (e) { if (!aborted) return { error: String(e) }; }
    return { text, fin, ttft, aborted };
  };
  const alone = [];
  for (let k = 0; k < DISTINCT; k++) alone.push(await runOne(k, 0));
  check(alone.every((a) => !a.error && a.text.length > 0), 'reference runs: ' + JSON.stringify(alone.filter((a) => a.error)));
  // a first wave of the same load (disconnects included) warms what the
  // engine sizes at start (KV pages, worker buffers) and the allocator;
  // memory is then measured around the second, identical wave
  const rssStart = (await metrics()).get('cm384_server_resident_bytes');
  await Promise.all(Array.from({ length: N }, (_, i) => runOne(i % DISTINCT, i % 4 === 3 ? 1 : 0)));
  for (let i = 0; i < 50 && (await metrics()).get('cm384_server_live_bytes') !== 0; i++) await sleep(100);
  const mb = await metrics();
  const poolBytes = mb.get('cm384_pool_bytes');
  const rssBefore = mb.get('cm384_server_resident_bytes'), liveBefore = mb.get('cm384_server_live_bytes'), memBefore = memory(poolBytes);
  const t0 = performance.now();
  const results = await Promise.all(Array.from({ length: N }, (_, i) => runOne(i % DISTINCT, i % 4 === 3 ? 1 : 0)));
  const wall = performance.now() - t0;
  let ok = 0, bad = 0, cut = 0;
  for (let i = 0; i < N; i++) {
    const res = results[i], ref = alone[i % DISTINCT];
    if (res.aborted) { cut++; continue; }
    if (!res.error && res.text === ref.text && res.fin === ref.fin) ok++;
    else { bad++; console.log(`  client ${i}: ${res.error ?? JSON.stringify(res.text) + ' vs ' + JSON.stringify(ref.text)}`); }
  }
  const ttfts = results.filter((x) => !x.error && x.ttft !== null).map((x) => x.ttft).sort((a, b) => a - b);
  const q = (p) => ttfts[Math.min(ttfts.length - 1, Math.floor(p * ttfts.length))];
  check(bad === 0 && ok === N - N / 4 && cut === N / 4, `load run: ${ok} complete and equal to their lone runs, ${bad} not, ${cut} disconnected`);
  // the server settles: every connection closed, every request object freed
  let ma;
  for (let i = 0; i < 100; i++) {
    ma = await metrics();
    if (ma.get('cm384_server_live_bytes') === 0 && ma.get('cm384_server_completions_total{state="finished"}') === ma.get('cm384_server_completions_total{state="started"}')) break;
    await sleep(100);
  }
  const rssAfter = ma.get('cm384_server_resident_bytes'), liveAfter = ma.get('cm384_server_live_bytes'), memAfter = memory(poolBytes);
  const mib = (x) => (x / 1048576).toFixed(1);
  check(liveBefore === 0 && liveAfter === 0, `server-held bytes before/after the load run: ${liveBefore} / ${liveAfter}`);
  if (TSAN) { /* no memory figures */ } else if (memBefore && memAfter) {
    // the pool's pages may be touched for the first time (more blocks in use at
    // a peak than before); the rest must come back to where it was
    check(memBefore.pool > 0 && memAfter.pool <= poolBytes + 8 * 1048576, `the KV pool mapping: ${memBefore.pool} / ${memAfter.pool} of ${poolBytes}`);
    check(memAfter.other <= memBefore.other + 1048576,
          `heap, stacks and other anonymous memory before/after the load run: ${mib(memBefore.other)} / ${mib(memAfter.other)} MiB`);
  } else check(rssAfter <= rssBefore + 16 * 1048576, `resident memory before/after the load run (no /proc smaps): ${rssBefore} / ${rssAfter}`);
  check(ma.get('cm384_server_completions_total{state="disconnected"}') >= N / 4 + 1, 'disconnections counted');
  console.log(`load run: ${N} concurrent streaming clients (${DISTINCT} distinct requests x ${N / DISTINCT}, ${cut} disconnect after their first chunk), ` +
              `${ok} complete, ${bad} failures; client TTFT p50 ${q(0.5).toFixed(1)} ms, p99 ${q(0.99).toFixed(1)} ms; ` +
              `engine TTFT p50 ${ma.get('cm384_ttft_milliseconds{quantile="0.5"}')} ms, p99 ${ma.get('cm384_ttft_milliseconds{quantile="0.99"}')} ms; ` +
              `wall ${(wall / 1000).toFixed(2)} s; RSS at start ${mib(rssStart)} MiB, after a warm-up wave ${mib(rssBefore)} MiB, after the load run ${mib(rssAfter)} MiB` +
              (memBefore && memAfter ? ` (heap, stacks and other anonymous memory ${mib(memBefore.other)} -> ${mib(memAfter.other)} MiB; the ${mib(poolBytes)} MiB KV pool resident ${mib(memBefore.pool)} -> ${mib(memAfter.pool)} MiB; mapped files ${mib(memBefore.files)} -> ${mib(memAfter.files)} MiB)` : '') + '; ' +
              `server-held bytes before ${liveBefore}, after ${liveAfter}`);
  check(Date.now() < deadline, 'finished within the time bound');
} catch (e) {
  check(false, 'exception: ' + (e.stack || e));
}

// ---- shutdown: SIGTERM stops it cleanly ----
const code = await new Promise((resolve) => {
  if (srv.exitCode !== null) return resolve(srv.exitCode);
  srv.on('exit', (c) => resolve(c));
  srv.kill('SIGTERM');
  setTimeout(() => { srv.kill('SIGKILL'); resolve('killed'); }, 20_000);
});
check(code === 0, 'server exits 0 on SIGTERM: ' + code);
// ---- the command line ----
const run = (args) => new Promise((resolve) => execFile(bin, args, (err, stdout, stderr) => resolve({ code: err ? err.code : 0, stdout, stderr })));
let cl = await run(['--help']);
check(cl.code === 0 && /POST \/v1\/chat\/completions/.test(cl.stdout) && /--host ADDR/.test(cl.stdout), '--help');
cl = await run(['-m', modelDir, '--chat-format', 'deepseek-v9']);
check(cl.code === 2 && /unknown --chat-format/.test(cl.stderr), '--chat-format with an unknown name: ' + cl.code + ' ' + cl.stderr);
cl = await run(['--port']);
check(cl.code === 2 && /needs a value/.test(cl.stderr), 'an option without its value');
console.log(`server: ${passed} passed, ${failed} failed`);
process.exit(failed ? 1 : 0);
