// The shell: sign-in, the navigation, and which page the address (#/…) shows.
import { useEffect, useState } from "preact/hooks";
import { APIError, get, saveKey, savedKey, whenSignedOut } from "./api.js";
import { AdminOnly, ErrorBox, Spinner } from "./ui.jsx";
import { Audit } from "./pages/audit.jsx";
import { Pools } from "./pages/pools.jsx";
import { Sandbox } from "./pages/sandbox.jsx";
import { Sandboxes } from "./pages/sandboxes.jsx";
import { Secrets } from "./pages/secrets.jsx";
import { Template, Templates } from "./pages/templates.jsx";
import { TenantPage, Tenants } from "./pages/tenants.jsx";
import { Usage } from "./pages/usage.jsx";
import { Volumes } from "./pages/volumes.jsx";
import { Webhooks } from "./pages/webhooks.jsx";
import { Workers } from "./pages/workers.jsx";

function useRoute() {
  const read = () => (location.hash.replace(/^#\/?/, "") || "sandboxes").split("/").map(decodeURIComponent);
  const [route, setRoute] = useState(read);
  useEffect(() => {
    const changed = () => setRoute(read());
    addEventListener("hashchange", changed);
    return () => removeEventListener("hashchange", changed);
  }, []);
  return route;
}

function Logo() {
  return (
    <span class="logo">
      <svg viewBox="0 0 24 24" aria-hidden="true">
        <rect x="3" y="3" width="18" height="18" rx="5" class="logo-box" />
        <path d="M8 9h8M8 12h5M8 15h8" class="logo-lines" />
      </svg>
      SPACE
    </span>
  );
}

function SignIn({ onSignedIn, notice }) {
  const [key, setKey] = useState("");
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState(null);
  const submit = async (e) => {
    e.preventDefault();
    setBusy(true);
    setError(null);
    try {
      const me = await get("/v1/me", { key: key.trim() });
      saveKey(key.trim());
      onSignedIn(me);
    } catch (err) {
      setError(err.status === 401 ? new APIError(401, "That key was refused: it is not a valid API key, or it was revoked.", err.requestId) : err);
      setBusy(false);
    }
  };
  return (
    <div class="signin">
      <form class="signin-card" onSubmit={submit}>
        <Logo />
        <h1>Sign in to the console</h1>
        <p class="muted">
          Use an API key of your tenant (<code>space admin create-key TENANT</code>). It stays in this tab only and goes with every call as a bearer token.
        </p>
        {notice && <div class="notice">{notice}</div>}
        <label class="field">
          <span class="label">API key</span>
          <input name="key" type="password" autocomplete="off" spellcheck={false} placeholder="sk_space_…" value={key} onInput={(e) => setKey(e.target.value)} autofocus />
        </label>
        <ErrorBox error={error} title="Sign-in failed" />
        <button class="primary wide" type="submit" disabled={busy || !key.trim()}>
          {busy ? <Spinner label="Checking" /> : "Sign in"}
        </button>
      </form>
    </div>
  );
}

const NAV = [
  ["sandboxes", "Sandboxes"],
  ["templates", "Templates"],
  ["pools", "Warm pools"],
  ["volumes", "Volumes"],
  ["secrets", "Secrets"],
  ["webhooks", "Webhooks"],
  ["usage", "Usage"],
  ["audit", "Audit log"],
];
// Shown to admin keys only (the API refuses the rest anyway).
const ADMIN_NAV = [
  ["tenants", "Tenants"],
  ["workers", "Workers"],
];

function Page({ route, me }) {
  const [section, id, tab] = route;
  if (section === "sandboxes" && id) return <Sandbox id={id} tab={tab || "overview"} />;
  if (section === "sandboxes") return <Sandboxes />;
  if (section === "templates" && id) return <Template id={id} me={me} />;
  if (section === "templates") return <Templates me={me} />;
  if (section === "pools") return <Pools me={me} />;
  if (section === "volumes") return <Volumes />;
  if (section === "secrets") return <Secrets />;
  if (section === "webhooks") return <Webhooks />;
  if (section === "audit") return <Audit me={me} />;
  if (section === "usage") return <Usage me={me} range={id || "day"} />;
  if (section === "tenants" && !me.admin) return <AdminOnly title="Tenants" />;
  if (section === "tenants" && id) return <TenantPage id={id} me={me} />;
  if (section === "tenants") return <Tenants />;
  if (section === "workers") return me.admin ? <Workers /> : <AdminOnly title="Workers" />;
  return <ErrorBox error={new Error(`There is no page “${route.join("/")}”.`)} title="Not found" />;
}

export function App() {
  const route = useRoute();
  const [me, setMe] = useState(null);
  const [checking, setChecking] = useState(Boolean(savedKey()));
  const [notice, setNotice] = useState(null);

  const signOut = (message) => {
    saveKey(null);
    setMe(null);
    setNotice(message || null);
  };
  useEffect(() => {
    whenSignedOut(() => signOut("Your key is no longer accepted. Sign in again."));
    if (savedKey()) {
      get("/v1/me")
        .then(setMe)
        .catch(() => signOut())
        .finally(() => setChecking(false));
    }
  }, []);

  if (checking) return <div class="signin"><Spinner label="Loading" /></div>;
  if (!me) return <SignIn onSignedIn={(m) => { setNotice(null); setMe(m); }} notice={notice} />;
  return (
    <div class="shell">
      <nav class="sidebar">
        <Logo />
        <ul>
          {(me.admin ? [...NAV, ...ADMIN_NAV] : NAV).map(([path, label]) => (
            <li key={path}>
              <a href={`#/${path}`} class={route[0] === path ? "active" : ""}>
                {label}
              </a>
            </li>
          ))}
        </ul>
        <div class="whoami">
          <div class="tenant" title={me.tenant_id}>
            {me.tenant_name}
          </div>
          <div class="muted small">{me.admin ? <span class="pill">admin key</span> : "tenant key"}</div>
          <button class="ghost small" onClick={() => signOut("Signed out.")}>
            Sign out
          </button>
        </div>
      </nav>
      <main class="content">
        <Page route={route} me={me} />
      </main>
    </div>
  );
}
