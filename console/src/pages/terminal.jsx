// A terminal in the sandbox: xterm.js over the API's PTY WebSocket (/exec/ws). The first message
// is the exec request; then keystrokes go up as binary, output comes down as binary frames
// tagged 1 (stdout) or 2 (stderr), and `start`, `exit` and `error` events come as text.
import { FitAddon } from "@xterm/addon-fit";
import { Terminal as XTerm } from "@xterm/xterm";
import { useEffect, useRef, useState } from "preact/hooks";
import { sandboxPath, socketURL } from "../api.js";

// The user's login shell where the template has bash, else /bin/sh (as `space shell` does).
const SHELL = 'exec "$(command -v bash || echo /bin/sh)" -l';
const encoder = new TextEncoder();

export function Terminal({ id }) {
  const box = useRef(null);
  const [status, setStatus] = useState({ kind: "connecting", text: "Connecting…" });
  const [session, setSession] = useState(0);
  useEffect(() => {
    const term = new XTerm({
      cursorBlink: true,
      fontFamily: 'ui-monospace, "SFMono-Regular", "JetBrains Mono", Menlo, Consolas, monospace',
      fontSize: 13,
      theme: { background: "#0b1020", foreground: "#e2e8f0", cursor: "#7dd3fc" },
      scrollback: 5000,
    });
    const fit = new FitAddon();
    term.loadAddon(fit);
    term.open(box.current);
    fit.fit();
    const ws = new WebSocket(socketURL(sandboxPath(id, "/exec/ws")));
    ws.binaryType = "arraybuffer";
    ws.onopen = () => {
      ws.send(JSON.stringify({ cmd: SHELL, pty: true, rows: term.rows, cols: term.cols, env: { TERM: "xterm-256color" } }));
    };
    ws.onmessage = (msg) => {
      if (typeof msg.data === "string") {
        const event = JSON.parse(msg.data);
        if (event.type === "start") setStatus({ kind: "live", text: `Connected · shell pid ${event.pid}` });
        else if (event.type === "exit") setStatus({ kind: "ended", text: `The shell exited${event.exit_code !== null ? ` with ${event.exit_code}` : ""}` });
        else if (event.type === "error") setStatus({ kind: "failed", text: event.message });
        return;
      }
      term.write(new Uint8Array(msg.data, 1));
    };
    ws.onclose = (e) => {
      setStatus((s) => (s.kind === "live" || s.kind === "connecting" ? { kind: "ended", text: e.reason || "Disconnected" } : s));
    };
    const typed = term.onData((data) => ws.readyState === WebSocket.OPEN && ws.send(encoder.encode(data)));
    const resized = term.onResize(({ rows, cols }) => ws.readyState === WebSocket.OPEN && ws.send(JSON.stringify({ resize: [rows, cols] })));
    const observer = new ResizeObserver(() => fit.fit());
    observer.observe(box.current);
    term.focus();
    return () => {
      observer.disconnect();
      typed.dispose();
      resized.dispose();
      ws.close();
      term.dispose();
    };
  }, [id, session]);
  return (
    <div class="card terminal-card">
      <div class="terminal-bar">
        <span class={`status status-${status.kind}`} id="terminal-status">
          <span class="dot" />
          {status.text}
        </span>
        <button class="ghost small" onClick={() => setSession(session + 1)}>
          New session
        </button>
      </div>
      <div class="terminal" ref={box} id="terminal" />
    </div>
  );
}
