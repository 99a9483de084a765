// A sandbox's processes: those started through the API (running, and the last that ended),
// one started from the page, and the output of the one chosen, pushed by the API as it comes
// (a stream of its events, not polling).
import { useEffect, useRef, useState } from "preact/hooks";
import { get, json, ndjson, sandboxPath } from "../api.js";
import { Empty, ErrorBox, Spinner, ago, usePoll } from "../ui.jsx";

const KEEP = 256 * 1024; // characters of output kept on the page

// The process's output as it comes: its NDJSON events, stdout and stderr decoded, its end.
function useOutput(id, ref) {
  const [text, setText] = useState("");
  const [ended, setEnded] = useState(null);
  const [error, setError] = useState(null);
  useEffect(() => {
    if (ref === null) return undefined;
    const abort = new AbortController();
    setText("");
    setEnded(null);
    setError(null);
    const out = new TextDecoder();
    ndjson(
      sandboxPath(id, `/processes/${encodeURIComponent(ref)}/output`),
      (e) => {
        if (e.type === "stdout" || e.type === "stderr") {
          const bytes = Uint8Array.from(atob(e.data), (c) => c.charCodeAt(0));
          const piece = out.decode(bytes, { stream: true });
          setText((t) => (t + piece).slice(-KEEP));
        } else if (e.type === "exit") {
          setEnded(e.exit_code ?? `signal ${e.signal}`);
        }
      },
      abort.signal,
    ).catch((e) => {
      if (e.name !== "AbortError") setError(e);
    });
    return () => abort.abort();
  }, [id, ref]);
  return { text, ended, error };
}

function Output({ id, process }) {
  const { text, ended, error } = useOutput(id, String(process.pid));
  const box = useRef(null);
  useEffect(() => {
    if (box.current) box.current.scrollTop = box.current.scrollHeight;
  }, [text]);
  return (
    <div class="card">
      <div class="pad small">
        <span class="mono">{process.cmd || (process.argv || []).join(" ")}</span>{" "}
        <span class="muted" id="process-status">
          {ended !== null ? `ended: ${ended}` : "following its output as it comes"}
        </span>
      </div>
      <ErrorBox error={error} title="Output not followed" />
      <pre class="output" id="process-output" ref={box}>
        {text}
      </pre>
    </div>
  );
}

export function Processes({ id }) {
  const list = usePoll(() => get(sandboxPath(id, "/processes")), 3000, [id]);
  const [chosen, setChosen] = useState(null);
  const [cmd, setCmd] = useState("");
  const [error, setError] = useState(null);
  const start = async (e) => {
    e.preventDefault();
    setError(null);
    try {
      const made = await json("POST", sandboxPath(id, "/processes"), { body: { cmd } });
      setCmd("");
      setChosen(made);
      list.reload();
    } catch (err) {
      setError(err);
    }
  };
  const kill = async (p) => {
    try {
      await json("DELETE", sandboxPath(id, `/processes/${p.pid}`));
      list.reload();
    } catch (err) {
      setError(err);
    }
  };
  const items = [...(list.data?.processes || [])].sort((a, b) => b.started_at - a.started_at);
  return (
    <>
      <form class="toolbar" onSubmit={start}>
        <input class="grow mono" name="process-cmd" aria-label="Command" placeholder="A command to run in the background: python3 server.py" value={cmd} onInput={(e) => setCmd(e.target.value)} />
        <button class="primary" type="submit" disabled={!cmd.trim()}>
          Start
        </button>
      </form>
      <ErrorBox error={error || list.error} title="Not done" />
      {list.loading && !list.data ? (
        <Spinner label="Loading processes" />
      ) : !items.length ? (
        <div class="card">
          <Empty title="No processes">Processes started through the API (here, or by an SDK's background commands) show here.</Empty>
        </div>
      ) : (
        <div class="card scroll">
          <table class="table" id="processes">
            <thead>
              <tr>
                <th>PID</th>
                <th>Command</th>
                <th>Started</th>
                <th>State</th>
                <th />
              </tr>
            </thead>
            <tbody>
              {items.map((p) => (
                <tr key={p.pid} data-pid={p.pid} class={chosen?.pid === p.pid ? "chosen" : ""}>
                  <td class="mono">{p.pid}</td>
                  <td class="mono">
                    {p.tag && <span class="pill">{p.tag}</span>} {p.cmd || (p.argv || []).join(" ")}
                  </td>
                  <td class="muted">{ago(new Date(p.started_at * 1000).toISOString())}</td>
                  <td>{p.running ? "running" : `exited ${p.exit_code ?? `by signal ${p.signal}`}`}</td>
                  <td class="right">
                    <button class="ghost small" onClick={() => setChosen(p)}>
                      Output
                    </button>
                    {p.running && (
                      <button class="danger small" onClick={() => kill(p)}>
                        Kill
                      </button>
                    )}
                  </td>
                </tr>
              ))}
            </tbody>
          </table>
        </div>
      )}
      {chosen && <Output key={chosen.pid} id={id} process={chosen} />}
    </>
  );
}
