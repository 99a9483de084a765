// E2B's JavaScript SDKs, unmodified, through their documented uses against SPACE. Configured
// as an E2B user would: E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL. Prints one JSON object:
// each check's name and what it saw, so the Python test can say which one failed and why.
import { CommandExitError, NotFoundError, Sandbox } from 'e2b'
import { Sandbox as CodeInterpreter } from '@e2b/code-interpreter'

const checks = {}
const check = (name, ok, seen) => {
  checks[name] = { ok: Boolean(ok), seen }
}
const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

async function commands(sbx) {
  const done = await sbx.commands.run('echo $GREETING out; echo err >&2; pwd')
  check('run', done.exitCode === 0 && done.stdout === 'hi out\n/root\n' && done.stderr === 'err\n', done)
  const withEnv = await sbx.commands.run('echo $A', { envs: { A: 'given' }, cwd: '/tmp' })
  check('run with envs', withEnv.stdout === 'given\n', withEnv.stdout)
  try {
    await sbx.commands.run('echo partial; exit 3')
    check('exit code raises', false, 'no error')
  } catch (e) {
    check('exit code raises', e instanceof CommandExitError && e.exitCode === 3, String(e))
  }
  const seen = []
  await sbx.commands.run("printf 'a\\nb\\n'", { onStdout: (d) => seen.push(d) })
  check('stdout streamed', seen.join('') === 'a\nb\n', seen)

  const cat = await sbx.commands.run('cat', { background: true, stdin: true })
  await sbx.commands.sendStdin(cat.pid, 'fed\n')
  await sbx.commands.closeStdin(cat.pid)
  const fed = await cat.wait()
  check('stdin', fed.stdout === 'fed\n', fed.stdout)

  const sleeper = await sbx.commands.run('sleep 600', { background: true })
  const listed = (await sbx.commands.list()).map((p) => p.pid)
  check('list commands', listed.includes(sleeper.pid), listed)
  const again = await sbx.commands.connect(sleeper.pid)
  check('kill', (await sbx.commands.kill(sleeper.pid)) === true, sleeper.pid)
  try {
    await again.wait()
    check('killed ends', false, 'waited without an error')
  } catch (e) {
    check('killed ends', e instanceof CommandExitError, String(e))
  }
  check('kill again', (await sbx.commands.kill(sleeper.pid)) === false, 'second kill')
}

async function files(sbx) {
  await sbx.files.write('/tmp/js/a.txt', 'hello from js')
  check('write and read', (await sbx.files.read('/tmp/js/a.txt')) === 'hello from js', null)
  await sbx.files.write([
    { path: '/tmp/js/b.bin', data: new Uint8Array([0, 1, 2, 255]).buffer },
    { path: '/tmp/js/c.txt', data: 'c' },
  ])
  const bytes = await sbx.files.read('/tmp/js/b.bin', { format: 'bytes' })
  check('binary', Array.from(bytes).join() === '0,1,2,255', Array.from(bytes))
  const names = (await sbx.files.list('/tmp/js')).map((e) => e.name).sort()
  check('list files', names.join() === 'a.txt,b.bin,c.txt', names)
  check('make dir', (await sbx.files.makeDir('/tmp/js/d')) === true, null)
  check('make dir again', (await sbx.files.makeDir('/tmp/js/d')) === false, null)
  await sbx.files.rename('/tmp/js/c.txt', '/tmp/js/d/c.txt')
  check('rename', (await sbx.files.exists('/tmp/js/d/c.txt')) && !(await sbx.files.exists('/tmp/js/c.txt')), null)
  await sbx.files.remove('/tmp/js/d')
  check('remove', !(await sbx.files.exists('/tmp/js/d')), null)
  try {
    await sbx.files.read('/tmp/js/none')
    check('missing file', false, 'read')
  } catch (e) {
    check('missing file', e instanceof NotFoundError, String(e))
  }

  const events = []
  const watcher = await sbx.files.watchDir('/tmp/js', (ev) => events.push(ev), { recursive: true })
  await sbx.files.write('/tmp/js/watched.txt', 'w')
  for (let i = 0; i < 50 && !events.some((ev) => ev.name === 'watched.txt'); i++) await sleep(100)
  await watcher.stop()
  check('watch', events.some((ev) => ev.name === 'watched.txt'), events)
}

async function pty(sbx) {
  let out = ''
  const term = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => (out += new TextDecoder().decode(d)) })
  await sbx.pty.resize(term.pid, { cols: 100, rows: 30 })
  await sbx.pty.sendInput(term.pid, new TextEncoder().encode('stty size; exit\n'))
  await term.wait().catch(() => null)
  check('pty', out.includes('30 100'), out.slice(-200))
}

async function lifecycle(sbx, id) {
  await sbx.setTimeout(900_000)
  const found = await Sandbox.list({ query: { metadata: { suite: 'e2b-js', run: id } } }).nextItems()
  check('list by metadata', found.length === 1 && found[0].sandboxId === sbx.sandboxId, found.map((s) => s.sandboxId))
  await sbx.files.write('/root/kept.txt', 'kept')
  check('pause', (await sbx.pause()) === true, null)
  check('not running while paused', (await sbx.isRunning()) === false, null)
  const back = await Sandbox.connect(sbx.sandboxId)
  check('resume by connect', (await back.files.read('/root/kept.txt')) === 'kept', null)
  check('kill sandbox', (await back.kill()) === true, null)
  check('kill gone', (await Sandbox.kill(sbx.sandboxId)) === false, null)
}

async function codeInterpreter() {
  const ci = await CodeInterpreter.create({ timeoutMs: 600_000 })
  try {
    const plot = await ci.runCode('import matplotlib.pyplot as plt; plt.plot([1, 2]); plt.show()')
    const png = plot.results.find((r) => r.png)?.png ?? ''
    check('plot png', Buffer.from(png, 'base64').subarray(0, 4).toString('hex') === '89504e47', plot.error ?? plot.results.length)
    await ci.runCode('x = 41')
    const answer = await ci.runCode('x + 1')
    check('state kept', answer.text === '42', answer.text)
    const failed = await ci.runCode('1 / 0')
    check('error', failed.error?.name === 'ZeroDivisionError', failed.error)
    const ctx = await ci.createCodeContext({ cwd: '/tmp' })
    check('context', (await ci.runCode('import os; os.getcwd()', { context: ctx })).text === "'/tmp'", ctx)
  } finally {
    await ci.kill()
  }
}

const run = String(Date.now())
const sbx = await Sandbox.create('base', { timeoutMs: 600_000, metadata: { suite: 'e2b-js', run }, envs: { GREETING: 'hi' } })
try {
  for (const part of [commands, files, pty]) {
    try {
      await part(sbx)
    } catch (e) {
      check(`${part.name} threw`, false, String(e?.stack ?? e))
    }
  }
  await lifecycle(sbx, run).catch((e) => check('lifecycle threw', false, String(e?.stack ?? e)))
} finally {
  await Sandbox.kill(sbx.sandboxId).catch(() => null)
}
await codeInterpreter().catch((e) => check('code interpreter threw', false, String(e?.stack ?? e)))
console.log(JSON.stringify(checks))
