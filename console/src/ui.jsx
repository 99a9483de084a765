// Small pieces every page uses: polling, badges, tables' empty states, errors, dialogs, figures.
import { useCallback, useEffect, useRef, useState } from "preact/hooks";

// Calls `load` now and every `every` ms while the page shows it (not while the tab is hidden).
export function usePoll(load, every, deps = []) {
  const [state, setState] = useState({ data: undefined, error: null, loading: true });
  const alive = useRef(true);
  const run = useCallback(async () => {
    try {
      const data = await load();
      if (alive.current) setState({ data, error: null, loading: false });
    } catch (error) {
      if (alive.current && error.name !== "AbortError") {
        setState((s) => ({ data: s.data, error, loading: false }));
      }
    }
  }, deps);
  useEffect(() => {
    alive.current = true;
    setState((s) => ({ ...s, loading: true }));
    run();
    const timer = every ? setInterval(() => document.hidden || run(), every) : null;
    return () => {
      alive.current = false;
      if (timer) clearInterval(timer);
    };
  }, [run, every]);
  return { ...state, reload: run };
}

const TRANSITIONAL = new Set(["pending", "starting", "pausing", "resuming", "suspending", "deleting", "claiming", "queued", "building"]);

export function StateBadge({ state }) {
  const kind = TRANSITIONAL.has(state) ? "busy" : state;
  return (
    <span class={`badge badge-${kind}`} data-state={state}>
      <span class="dot" />
      {state}
    </span>
  );
}

export function Empty({ title, children, action }) {
  return (
    <div class="empty">
      <div class="empty-mark" />
      <h3>{title}</h3>
      {children && <p>{children}</p>}
      {action}
    </div>
  );
}

export function ErrorBox({ error, title = "Something went wrong" }) {
  if (!error) return null;
  return (
    <div class="error" role="alert">
      <strong>{error.status === 403 ? "Not allowed" : title}</strong>
      <span>{error.message}</span>
      {error.requestId && <code class="muted">request {error.requestId}</code>}
    </div>
  );
}

// Where a page for admin keys would be, for any other key (the API would refuse it anyway).
export function AdminOnly({ title }) {
  return (
    <section>
      <PageHeader title={title} />
      <div class="card">
        <Empty title="For admin keys only">This page is for the operators of the deployment. Sign in with an admin key to see it.</Empty>
      </div>
    </section>
  );
}

export function Spinner({ label }) {
  return (
    <span class="spinner-wrap">
      <span class="spinner" />
      {label && <span>{label}</span>}
    </span>
  );
}

export function Dialog({ title, onClose, children, footer }) {
  useEffect(() => {
    const key = (e) => e.key === "Escape" && onClose();
    addEventListener("keydown", key);
    return () => removeEventListener("keydown", key);
  }, [onClose]);
  return (
    <div class="backdrop" onClick={(e) => e.target === e.currentTarget && onClose()}>
      <div class="dialog" role="dialog" aria-label={title}>
        <header>
          <h2>{title}</h2>
          <button class="icon" aria-label="Close" onClick={onClose}>
            ×
          </button>
        </header>
        <div class="dialog-body">{children}</div>
        {footer && <footer>{footer}</footer>}
      </div>
    </div>
  );
}

export function Field({ label, hint, children }) {
  return (
    <label class="field">
      <span class="label">{label}</span>
      {children}
      {hint && <span class="hint">{hint}</span>}
    </label>
  );
}

export function PageHeader({ title, subtitle, children }) {
  return (
    <div class="page-header">
      <div>
        <h1>{title}</h1>
        {subtitle && <p class="subtitle">{subtitle}</p>}
      </div>
      <div class="actions">{children}</div>
    </div>
  );
}

export function Sparkline({ values, max }) {
  const w = 160;
  const h = 36;
  if (values.length < 2) return <svg class="spark" viewBox={`0 0 ${w} ${h}`} />;
  const top = Math.max(max ?? 0, ...values, 1e-9);
  const step = w / (values.length - 1);
  const points = values.map((v, i) => `${(i * step).toFixed(1)},${(h - 2 - (v / top) * (h - 4)).toFixed(1)}`);
  return (
    <svg class="spark" viewBox={`0 0 ${w} ${h}`} preserveAspectRatio="none">
      <polygon class="spark-fill" points={`0,${h} ${points.join(" ")} ${w},${h}`} />
      <polyline class="spark-line" points={points.join(" ")} />
    </svg>
  );
}

const UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];
export function bytes(n) {
  if (n === null || n === undefined) return "—";
  let i = 0;
  let v = n;
  while (v >= 1024 && i < UNITS.length - 1) {
    v /= 1024;
    i++;
  }
  return `${v >= 100 || i === 0 ? v.toFixed(0) : v.toFixed(1)} ${UNITS[i]}`;
}

export function mib(n) {
  return bytes(n * 1024 * 1024);
}

export function ago(when) {
  if (!when) return "—";
  const s = Math.max(0, (Date.now() - new Date(when).getTime()) / 1000);
  if (s < 60) return `${Math.floor(s)}s ago`;
  if (s < 3600) return `${Math.floor(s / 60)}m ago`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ago`;
  return `${Math.floor(s / 86400)}d ago`;
}

export function when(t) {
  return t ? new Date(t).toLocaleString() : "—";
}

export function link(path) {
  return `#${path}`;
}

// Lines of `key=value` (or comma-separated) into an object; throws on a line without `=`.
export function pairs(text) {
  const out = {};
  for (const part of text.split(/[\n,]/).map((p) => p.trim()).filter(Boolean)) {
    const at = part.indexOf("=");
    if (at < 1) throw new Error(`"${part}" is not key=value`);
    out[part.slice(0, at).trim()] = part.slice(at + 1).trim();
  }
  return out;
}

export function Confirm({ title, children, action, danger, onConfirm, onClose }) {
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState(null);
  const go = async () => {
    setBusy(true);
    setError(null);
    try {
      await onConfirm();
      onClose();
    } catch (e) {
      setError(e);
      setBusy(false);
    }
  };
  return (
    <Dialog
      title={title}
      onClose={onClose}
      footer={
        <>
          <button class="ghost" onClick={onClose}>
            Cancel
          </button>
          <button class={danger ? "danger" : "primary"} disabled={busy} onClick={go}>
            {busy ? <Spinner label={action} /> : action}
          </button>
        </>
      }
    >
      {children}
      <ErrorBox error={error} />
    </Dialog>
  );
}
