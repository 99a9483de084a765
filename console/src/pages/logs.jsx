// A sandbox's serial console (kernel and agent messages, /dev/console), followed as the API
// pushes it: one long answer read as it comes, not polling.
import { useEffect, useRef, useState } from "preact/hooks";
import { sandboxPath, stream } from "../api.js";
import { ErrorBox } from "../ui.jsx";

const KEEP = 256 * 1024; // characters kept on the page

export function Logs({ id }) {
  const [text, setText] = useState("");
  const [state, setState] = useState("following");
  const [error, setError] = useState(null);
  const box = useRef(null);
  useEffect(() => {
    const abort = new AbortController();
    setText("");
    setState("following");
    stream(sandboxPath(id, "/logs?follow=true"), (piece) => setText((t) => (t + piece).slice(-KEEP)), abort.signal)
      .then(() => setState("ended"))
      .catch((e) => {
        if (e.name !== "AbortError") {
          setError(e);
          setState("ended");
        }
      });
    return () => abort.abort();
  }, [id]);
  useEffect(() => {
    if (box.current) box.current.scrollTop = box.current.scrollHeight;
  }, [text]);
  return (
    <div class="card">
      <div class="pad small muted" id="logs-status">
        {state === "following" ? "Following its serial console as it comes." : "Its VM stopped: the console ended."}
      </div>
      <ErrorBox error={error} title="Console not followed" />
      <pre class="output tall" id="logs">
        {text}
      </pre>
    </div>
  );
}
