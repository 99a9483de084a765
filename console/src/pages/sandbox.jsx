// One sandbox: its figures, details and actions, and tabs for its terminal, files, processes,
// console log, events and egress audit log.
import { useEffect, useRef, useState } from "preact/hooks";
import { get, json, ndjson, sandboxPath } from "../api.js";
import { Confirm, Empty, ErrorBox, PageHeader, Sparkline, Spinner, StateBadge, ago, bytes, link, mib, usePoll, when } from "../ui.jsx";
import { Files } from "./files.jsx";
import { Logs } from "./logs.jsx";
import { Processes } from "./processes.jsx";
import { Terminal } from "./terminal.jsx";

const TABS = [
  ["overview", "Overview"],
  ["terminal", "Terminal"],
  ["files", "Files"],
  ["processes", "Processes"],
  ["logs", "Logs"],
  ["events", "Events"],
  ["egress", "Egress"],
];
const HISTORY = 60; // readings kept for the sparklines (2 minutes)

// Rates between consecutive readings of the stats endpoint.
function useFigures(id, running) {
  const [history, setHistory] = useState([]);
  const [error, setError] = useState(null);
  const last = useRef(null);
  useEffect(() => {
    if (!running) return undefined;
    let alive = true;
    const read = async () => {
      try {
        const s = await get(sandboxPath(id, "/stats"));
        if (!alive) return;
        setError(null);
        const prev = last.current;
        last.current = s;
        if (!prev) return setHistory([{ s, cpu: 0, rx: 0, tx: 0 }]);
        const dt = Math.max(s.at - prev.at, 1e-3);
        const point = {
          s,
          cpu: Math.max(0, (s.cpu_seconds - prev.cpu_seconds) / dt),
          rx: Math.max(0, ((s.net_rx_bytes ?? 0) - (prev.net_rx_bytes ?? 0)) / dt),
          tx: Math.max(0, ((s.net_tx_bytes ?? 0) - (prev.net_tx_bytes ?? 0)) / dt),
        };
        setHistory((h) => [...h.slice(-HISTORY + 1), point]);
      } catch (e) {
        if (alive) setError(e);
      }
    };
    read();
    const timer = setInterval(() => document.hidden || read(), 2000);
    return () => {
      alive = false;
      clearInterval(timer);
    };
  }, [id, running]);
  return { history, error };
}

function Figure({ label, value, detail, values, max, id }) {
  return (
    <div class="figure card" id={id}>
      <div class="figure-label">{label}</div>
      <div class="figure-value">{value}</div>
      <div class="figure-detail muted">{detail}</div>
      <Sparkline values={values} max={max} />
    </div>
  );
}

function Figures({ sb }) {
  const running = sb.state === "running";
  const { history, error } = useFigures(sb.id, running);
  if (!running) {
    return (
      <div class="card pad muted" id="figures-off">
        Figures are measured on the host while the sandbox runs; it is {sb.state}.
      </div>
    );
  }
  const now = history[history.length - 1];
  if (!now) return <div class="card pad">{error ? <ErrorBox error={error} title="Figures not read" /> : <Spinner label="Measuring" />}</div>;
  const s = now.s;
  const pct = (v) => `${(100 * v).toFixed(v < 0.1 ? 1 : 0)}%`;
  return (
    <div class="figures">
      <Figure id="fig-cpu" label="CPU" value={pct(now.cpu)} detail={`of one host core · ${s.cpu_seconds.toFixed(1)} s in all`} values={history.map((p) => p.cpu)} max={Math.max(1, s.vcpus * 0.25)} />
      <Figure id="fig-memory" label="Memory" value={bytes(s.memory_bytes)} detail={`VMM's share (PSS) · guest has ${mib(s.memory_mib)}`} values={history.map((p) => p.s.memory_bytes)} max={s.memory_mib * 1048576} />
      <Figure id="fig-disk" label="Disk" value={bytes(s.disk_bytes)} detail={`allocated on the pool · of ${mib(sb.disk_mib)}`} values={history.map((p) => p.s.disk_bytes)} />
      <Figure
        id="fig-network"
        label="Network"
        value={s.net_rx_bytes === null ? "no NIC" : `↓ ${bytes(s.net_rx_bytes)}  ↑ ${bytes(s.net_tx_bytes)}`}
        detail={`now ↓ ${bytes(now.rx)}/s ↑ ${bytes(now.tx)}/s`}
        values={history.map((p) => p.rx + p.tx)}
      />
    </div>
  );
}

function Details({ sb }) {
  const rows = [
    ["Template", sb.template],
    ["Boot", sb.boot || "—"],
    ["Size", `${sb.vcpus} vCPU · ${mib(sb.memory_mib)} memory · ${mib(sb.disk_mib)} disk`],
    ["Timeout", `${sb.timeout_s} s, then ${sb.timeout_action}${sb.expires_at ? ` (${when(sb.expires_at)})` : ""}`],
    ["Worker", sb.worker_id || "—"],
    ["Created", when(sb.created_at)],
    ["Egress", sb.network ? (sb.network.hosts || []).map((h) => h.pattern).join(", ") || "nothing allowed" : "the deployment's default"],
    ["Secrets", (sb.secrets || []).map((b) => `${b.secret} → ${b.hosts.join(", ")}`).join("; ") || "none"],
    ["Volumes", sb.volumes.map((v) => `${v.volume} at ${v.path}${v.read_only ? " (read-only)" : ""}`).join(", ") || "none"],
    ["Metadata", Object.entries(sb.metadata).map(([k, v]) => `${k}=${v}`).join(", ") || "none"],
    ["Environment", Object.keys(sb.env).join(", ") || "none"],
  ];
  return (
    <div class="card">
      <dl class="details">
        {rows.map(([k, v]) => (
          <div key={k}>
            <dt>{k}</dt>
            <dd>{v}</dd>
          </div>
        ))}
      </dl>
    </div>
  );
}

// Its events as the API pushes them (one long NDJSON answer), newest first; a dropped stream
// is taken up again from the last one seen.
function useEvents(id) {
  const [items, setItems] = useState(null);
  const [error, setError] = useState(null);
  useEffect(() => {
    const abort = new AbortController();
    let last = 0;
    setItems(null);
    (async () => {
      while (!abort.signal.aborted) {
        try {
          setItems((xs) => xs || []);
          await ndjson(sandboxPath(id, `/events?follow=true&after=${last}`), (e) => {
            last = e.id;
            setItems((xs) => [e, ...(xs || [])]);
          }, abort.signal);
          return; // it ended: the sandbox was deleted
        } catch (e) {
          if (e.name === "AbortError") return;
          setError(e);
          await new Promise((r) => setTimeout(r, 3000));
        }
      }
    })();
    return () => abort.abort();
  }, [id]);
  return { data: items && { items }, error };
}

function Events({ id }) {
  const { data, error } = useEvents(id);
  if (error && !data) return <ErrorBox error={error} title="Events not loaded" />;
  if (!data) return <Spinner label="Loading events" />;
  return (
    <div class="card">
      <table class="table" id="events">
        <thead>
          <tr>
            <th>When</th>
            <th>What</th>
            <th>From</th>
            <th>To</th>
            <th>Reason</th>
          </tr>
        </thead>
        <tbody>
          {data.items.map((e) => (
            <tr key={e.id}>
              <td class="muted" title={e.at}>
                {when(e.at)}
              </td>
              <td>{e.type}</td>
              <td>{e.from_state ? <StateBadge state={e.from_state} /> : "—"}</td>
              <td>{e.to_state ? <StateBadge state={e.to_state} /> : "—"}</td>
              <td class="muted">{e.reason || ""}</td>
            </tr>
          ))}
        </tbody>
      </table>
    </div>
  );
}

function Egress({ id }) {
  const { data, error } = usePoll(() => get(sandboxPath(id, "/audit")), 5000, [id]);
  if (error) return <ErrorBox error={error} title="Audit log not loaded" />;
  if (!data) return <Spinner label="Loading the audit log" />;
  if (!data.items.length) {
    return (
      <div class="card">
        <Empty title="No egress yet">Every connection and name lookup the sandbox tries is decided by its gateway and shows here, allowed or denied, with why.</Empty>
      </div>
    );
  }
  return (
    <div class="card">
      <table class="table" id="audit">
        <thead>
          <tr>
            <th>When</th>
            <th>Kind</th>
            <th>Decision</th>
            <th>Host</th>
            <th>Address</th>
            <th>Reason</th>
          </tr>
        </thead>
        <tbody>
          {data.items.map((e) => (
            <tr key={e.seq}>
              <td class="muted">{e.time ? when(typeof e.time === "number" ? e.time * 1000 : e.time) : "—"}</td>
              <td>{e.kind}</td>
              <td>
                <span class={`decision decision-${e.decision}`}>{e.decision}</span>
              </td>
              <td class="mono">
                {e.host || "—"}
                {e.port ? `:${e.port}` : ""}
              </td>
              <td class="mono muted">{e.address || ""}</td>
              <td class="muted">{e.reason || ""}</td>
            </tr>
          ))}
        </tbody>
      </table>
    </div>
  );
}

const ACTIONS = {
  running: [["pause", "Pause"], ["suspend", "Suspend"]],
  paused: [["resume", "Resume"], ["suspend", "Suspend"]],
  suspended: [["resume", "Resume"]],
};

export function Sandbox({ id, tab }) {
  const { data: sb, error, reload } = usePoll(() => get(sandboxPath(id)), 2000, [id]);
  const [busy, setBusy] = useState(null);
  const [actionError, setActionError] = useState(null);
  const [deleting, setDeleting] = useState(false);
  if (error && !sb) {
    return (
      <section>
        <PageHeader title={id} />
        <ErrorBox error={error} title={error.status === 404 ? "No such sandbox" : "Not loaded"} />
        <a href="#/sandboxes">← All sandboxes</a>
      </section>
    );
  }
  if (!sb) return <Spinner label="Loading" />;
  const act = async (verb) => {
    setBusy(verb);
    setActionError(null);
    try {
      await json("POST", sandboxPath(id, `/${verb}`));
      await reload();
    } catch (e) {
      setActionError(e);
    }
    setBusy(null);
  };
  return (
    <section>
      <div class="crumbs">
        <a href="#/sandboxes">Sandboxes</a> / <span class="mono">{id}</span>
      </div>
      <PageHeader
        title={
          <>
            <span class="mono">{sb.id}</span> <StateBadge state={sb.state} />
          </>
        }
        subtitle={`${sb.template} · created ${ago(sb.created_at)}${sb.reason ? ` · ${sb.reason}` : ""}`}
      >
        {(ACTIONS[sb.state] || []).map(([verb, label]) => (
          <button key={verb} class="ghost" disabled={busy !== null} onClick={() => act(verb)}>
            {busy === verb ? <Spinner label={label} /> : label}
          </button>
        ))}
        {sb.state !== "deleted" && (
          <button class="danger" id="delete-sandbox" disabled={busy !== null} onClick={() => setDeleting(true)}>
            Delete
          </button>
        )}
      </PageHeader>
      <ErrorBox error={actionError} title="Not done" />
      <div class="tabs" role="tablist">
        {TABS.map(([t, label]) => (
          <a key={t} role="tab" href={link(`/sandboxes/${id}/${t}`)} class={tab === t ? "active" : ""}>
            {label}
          </a>
        ))}
      </div>
      {tab === "overview" && (
        <>
          <Figures sb={sb} />
          <Details sb={sb} />
        </>
      )}
      {tab === "terminal" && (sb.state === "running" ? <Terminal id={id} /> : <div class="card pad muted">The terminal opens while the sandbox runs; it is {sb.state}.</div>)}
      {tab === "files" && (sb.state === "running" ? <Files id={id} /> : <div class="card pad muted">Files can be browsed while the sandbox runs; it is {sb.state}.</div>)}
      {tab === "processes" && (sb.state === "running" ? <Processes id={id} /> : <div class="card pad muted">Processes are shown while the sandbox runs; it is {sb.state}.</div>)}
      {tab === "logs" && (["running", "paused"].includes(sb.state) ? <Logs id={id} /> : <div class="card pad muted">A sandbox has a console while its VM lives; it is {sb.state}.</div>)}
      {tab === "events" && <Events id={id} />}
      {tab === "egress" && <Egress id={id} />}
      {deleting && (
        <Confirm
          title="Delete this sandbox?"
          action="Delete"
          danger
          onClose={() => setDeleting(false)}
          onConfirm={async () => {
            await json("DELETE", sandboxPath(id));
            await reload();
          }}
        >
          <p>
            Its VM stops and its disk is removed; <span class="mono">{id}</span> stays listed as deleted. This cannot be undone.
          </p>
        </Confirm>
      )}
    </section>
  );
}
