// Entry point. The page's Content-Security-Policy admits only styles with this page's nonce,
// and xterm.js writes <style> elements of its own: each one made gets the nonce at creation,
// before it is inserted (afterwards a browser ignores it).
import "@xterm/xterm/css/xterm.css";
import "./styles.css";
import { render } from "preact";
import { App } from "./app.jsx";

const nonce = document.currentScript && document.currentScript.nonce;
if (nonce) {
  const create = Document.prototype.createElement;
  Document.prototype.createElement = function (name, options) {
    const element = create.call(this, name, options);
    if (String(name).toLowerCase() === "style") element.setAttribute("nonce", nonce);
    return element;
  };
}

render(<App />, document.getElementById("app"));
