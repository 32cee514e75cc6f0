"""The chat page in a real browser (Selenium driving Debian's headless chromium and chromedriver),
in front of the bundled arith-gen + arith-prm + arith-router: sign in, send an example question
from the empty conversation, stream an answer and see it grow, reload and see the history, change
settings and see them reach the backend, export XLSX and read it back, search mode's candidates
and step scores, tools mode's SymPy through the bundled router, an answer full of markup that
runs nothing, a second user who cannot open the first one's conversation, and Regenerate and Edit
(stored, stopping an answer that streams, an edit full of markup shown as text).

Screenshots go to a temporary folder, or to docs/images/ with TREESERVE_SCREENSHOTS=docs (how the
ones in docs/ were taken)."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import openpyxl
import pytest
from selenium.webdriver import ActionChains
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select

from chat_support import add_user, arith_backend, chat_stack, stopped_answers
from test_chat_router import QUESTIONS
from treeserve.cli_chat import EXAMPLES

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists() else None)
pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER), reason="needs Debian's chromium and chromium-driver "
                                "(`make test` installs them where apt-get is available)")
QUESTION = "Start with 44 and work modulo 100. Step 1: * 7. Step 2: + 9. Step 3: - 4. Step 4: + 5. What is the result?"
HOSTILE = '<img src=x onerror="window.__xss=1"><script>window.__xss=2</script><b onmouseover="window.__xss=3">hi</b>'


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    database = f"sqlite:///{tmp_path_factory.mktemp('chat') / 'gateway.db'}"
    with arith_backend() as (backend_url, tap), \
            chat_stack(database, backend_url, router="arith-router") as (url, gateway, scripted, _):
        add_user(gateway, "ada", "correct horse battery")
        add_user(gateway, "bob", "another long password")
        yield url, tap, scripted


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    downloads = tmp_path_factory.mktemp("downloads")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--window-size=1280,900", "--disable-extensions"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the page's console, read at the end
    options.add_experimental_option("prefs", {"download.default_directory": str(downloads),
                                              "download.prompt_for_download": False})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    driver.downloads = downloads
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    if os.environ.get("TREESERVE_SCREENSHOTS") == "docs":
        folder = Path(__file__).resolve().parents[1] / "docs" / "images"
        folder.mkdir(exist_ok=True)
        return folder
    return tmp_path_factory.mktemp("screenshots")


def by(testid: str) -> tuple[str, str]:
    return ("css selector", f'[data-testid="{testid}"]')


def wait(driver, predicate, timeout: float = 60.0):
    """Polls `predicate` until it holds; an element the page re-rendered between finding and reading it
    (the list redrawn as a rename lands) is read again at the next poll, as one not there yet."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05,
                         ignored_exceptions=(StaleElementReferenceException,)).until(lambda d: predicate(d))


def sign_in(driver, url: str, user: str, password: str) -> None:
    driver.get(url + "/chat")
    wait(driver, lambda d: d.find_element(*by("login-username")).is_displayed())
    driver.find_element(*by("login-username")).send_keys(user)
    driver.find_element(*by("login-password")).send_keys(password)
    driver.find_element(*by("login-submit")).click()
    wait(driver, lambda d: d.find_element(*by("new-chat")).is_displayed())


def new_chat(driver) -> None:
    """An empty chat, stored only once its first message is sent (it used to be stored at once)."""
    driver.find_element(*by("new-chat")).click()
    wait(driver, lambda d: d.current_url.endswith("/chat") and not d.find_elements(*by("message-user")))


def set_field(driver, testid: str, value: str) -> None:
    field = driver.find_element(*by(testid))
    field.clear()
    field.send_keys(value)
    driver.find_element(*by("messages")).click()  # leaving the field saves the settings (a change event)


def send(driver, text: str) -> None:
    answers = len(driver.find_elements(*by("message-assistant")))
    if "\n" in text:  # (typed, Enter would send the first line: the value is pasted instead)
        driver.execute_script("arguments[0].value = arguments[1]", driver.find_element(*by("message-input")), text)
    else:
        driver.find_element(*by("message-input")).send_keys(text)
    driver.find_element(*by("send")).click()
    wait(driver, lambda d: len(d.find_elements(*by("message-assistant"))) > answers
         and not d.find_elements("css selector", ".message.streaming"), timeout=120)


def _words(text: str) -> list[str]:
    return text.replace("#", " ").split()


def last_answer(driver) -> str:
    return driver.find_elements(*by("message-assistant"))[-1].find_element(*by("message-content")).text


def test_the_chat_page_end_to_end(stack, browser, shots):
    url, tap, _ = stack
    driver = browser
    sign_in(driver, url, "ada", "correct horse battery")

    # the empty conversation offers the bundled model's examples; a click sends one in its mode
    examples = wait(driver, lambda d: d.find_elements(*by("example")))
    assert [e.get_attribute("data-mode") for e in examples] == [e["mode"] for e in EXAMPLES]
    examples[0].click()
    wait(driver, lambda d: d.find_elements(*by("message-assistant"))
         and not d.find_elements("css selector", ".message.streaming"), timeout=120)
    assert driver.find_element(*by("message-user")).find_element(*by("message-content")).text == EXAMPLES[0]["text"]
    assert last_answer(driver) and not driver.find_elements(*by("examples"))

    new_chat(driver)
    set_field(driver, "settings-max-tokens", "96")
    listed = len(driver.find_elements(*by("conversation-item")))

    # streaming: the page's text grows chunk by chunk (recorded by a MutationObserver in the page)
    driver.execute_script("""
        window.__lengths = [];
        new MutationObserver(() => {
          const live = document.querySelector('.message.streaming [data-testid="message-content"]');
          if (live) window.__lengths.push(live.textContent.length);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});""")
    send(driver, QUESTION)
    lengths = driver.execute_script("return window.__lengths")
    grown = sorted(set(n for n in lengths if n > 0))
    answer = last_answer(driver)
    assert len(grown) >= 3 and answer, (lengths, answer)
    conversation_url = driver.current_url
    assert "/chat/c/" in conversation_url
    wait(driver, lambda d: len(d.find_elements(*by("conversation-item"))) == listed + 1)

    driver.refresh()  # the history comes back from the database
    wait(driver, lambda d: len(d.find_elements(*by("message-assistant"))) == 1)
    assert driver.current_url == conversation_url
    assert driver.find_element(*by("message-user")).find_element(*by("message-content")).text == QUESTION
    assert last_answer(driver) == answer

    set_field(driver, "settings-temperature", "0.33")  # (step="any": 0.33 and 0.955 were refused by step 0.05 / 0.01)
    set_field(driver, "settings-top-p", "0.955")
    set_field(driver, "settings-system-prompt", "You are a terse calculator.")
    send(driver, "Start with 3 and work modulo 100. Step 1: + 4. What is the result?")
    received = [b for path, b in tap.bodies if path == "/v1/chat/completions"][-1]
    assert received["temperature"] == 0.33 and received["top_p"] == 0.955 and received["max_tokens"] == 96
    assert received["messages"][0] == {"role": "system", "content": "You are a terse calculator."}
    assert [m["role"] for m in received["messages"]] == ["system", "user", "assistant", "user"]
    driver.save_screenshot(str(shots / "chat.png"))

    driver.find_element(*by("export-xlsx")).click()
    conversation_id = conversation_url.rsplit("/", 1)[1]
    xlsx = driver.downloads / f"conversation-{conversation_id}.xlsx"
    wait(driver, lambda d: xlsx.exists() and xlsx.stat().st_size > 0, timeout=30)
    time.sleep(0.2)
    rows = list(openpyxl.load_workbook(xlsx).active.iter_rows(values_only=True))
    assert [r[3] for r in rows[1:]] == ["user", "assistant", "user", "assistant"]
    assert rows[1][4] == QUESTION and _words(rows[2][4]) == _words(answer)  # (the page shows it as Markdown)
    assert '"temperature": 0.33' in rows[3][7] and "terse calculator" in rows[3][7]
    driver.find_element(*by("export-json")).click()
    wait(driver, lambda d: (driver.downloads / f"conversation-{conversation_id}.json").exists(), timeout=30)

    # the bundled model's context is 512 tokens: with max tokens 400 the oldest turns are left out (said
    # subtly in the answer's header); a message that cannot fit alone is told so, and does not stop the next
    set_field(driver, "settings-max-tokens", "400")
    send(driver, "Start with 8 and work modulo 100. Step 1: + 1. What is the result?")
    received = [b for path, b in tap.bodies if path == "/v1/chat/completions"][-1]
    assert [m["role"] for m in received["messages"]][:2] == ["system", "user"] and len(received["messages"]) < 6
    left_out = driver.find_elements(*by("message-assistant"))[-1].find_element(*by("left-out")).text
    n = 6 - len(received["messages"])  # (sent: the system prompt, 4 earlier messages, the new one)
    assert left_out == f"· {n} earlier message{'s' if n > 1 else ''} left out", left_out
    assert not last_answer(driver).startswith("max_tokens")
    assert len(driver.find_elements(*by("left-out"))) == 1  # only where messages were left out
    # the notice is text: one message is said so, and what is not a count shows nothing and runs nothing
    notices = driver.execute_script("""return [1, 0, '<img src=x onerror="window.__xss=4">'].map((n) => {
        const shown = renderMessage({role: 'assistant', content: '', mode: 'chat', details: {left_out: n}});
        return [shown.querySelector('[data-testid="left-out"]')?.textContent ?? null, shown.querySelectorAll('img').length];
        })""")
    assert notices == [[" · 1 earlier message left out", 0], [None, 0], [None, 0]], notices
    set_field(driver, "settings-max-tokens", "8000")
    too_long = "Start with 9 and work modulo 100. Step 1: + 1. What is the result?"
    send(driver, too_long)
    error = driver.find_elements(*by("message-assistant"))[-1].find_element("css selector", ".error").text
    assert "does not fit arith-gen's context of 512 tokens" in error, error
    # the message stays in the conversation, and is given back in the box to shorten
    assert driver.find_elements(*by("message-user"))[-1].find_element(*by("message-content")).text == too_long
    assert driver.find_element(*by("message-input")).get_attribute("value") == too_long
    driver.find_element(*by("message-input")).clear()
    set_field(driver, "settings-max-tokens", "96")
    send(driver, "Start with 9 and work modulo 100. Step 1: + 2. What is the result?")
    assert last_answer(driver) and not driver.find_elements(*by("message-assistant"))[-1].find_elements(
        "css selector", ".error")

    # a message the gateway refuses stays in the box, and an empty chat keeps its examples; a new chat's
    # first message refused leaves no empty conversation behind (the page is a new chat again)
    new_chat(driver)
    listed = len(driver.find_elements(*by("conversation-item")))
    driver.execute_script("""window.__fetch = window.fetch; window.fetch = (url, options) => url.endsWith('/messages')
        ? Promise.resolve(new Response(JSON.stringify({error: {message: 'refused for the test'}}), {status: 400}))
        : window.__fetch(url, options);""")
    driver.find_element(*by("message-input")).send_keys("keep me")
    driver.find_element(*by("send")).click()
    wait(driver, lambda d: d.find_element(*by("notice")).text == "refused for the test")
    assert driver.find_element(*by("message-input")).get_attribute("value") == "keep me"
    assert driver.find_elements(*by("example"))
    wait(driver, lambda d: d.current_url.endswith("/chat")
         and len(d.find_elements(*by("conversation-item"))) == listed, timeout=10)
    assert len(driver.execute_async_script("""fetch('/chat/api/conversations').then((r) => r.json())
        .then((body) => arguments[0](body.conversations))""")) == listed
    driver.execute_script("window.fetch = window.__fetch")
    # an IME's Enter (composing a word) does not send
    driver.execute_script("""arguments[0].dispatchEvent(new KeyboardEvent('keydown', {key: 'Enter', keyCode: 229,
        isComposing: true, bubbles: true, cancelable: true}))""", driver.find_element(*by("message-input")))
    time.sleep(0.3)
    assert driver.find_element(*by("message-input")).get_attribute("value") == "keep me"
    assert not driver.find_elements(*by("message-user")) and driver.find_element(*by("stop")).get_attribute("disabled")
    driver.find_element(*by("message-input")).clear()
    # conversations open from the keyboard
    item = driver.find_element("css selector", f'[data-testid="conversation-item"][data-id="{conversation_id}"]')
    driver.execute_script("arguments[0].focus()", item)
    ActionChains(driver).send_keys(Keys.ENTER).perform()
    wait(driver, lambda d: d.current_url == conversation_url)

    # search mode: candidates with their scores and step-score charts
    new_chat(driver)
    driver.find_element(*by("mode-search")).click()
    set_field(driver, "settings-search-n", "4")
    Select(driver.find_element(*by("settings-search-strategy"))).select_by_value("best_of_n")
    set_field(driver, "settings-temperature", "0.8")
    set_field(driver, "settings-system-prompt", "")
    send(driver, QUESTION)
    candidates = wait(driver, lambda d: d.find_elements(*by("search-candidate")))
    assert len(candidates) == 4
    for candidate in candidates:
        assert candidate.find_element(*by("candidate-score")).text.startswith("score 0.")
        assert candidate.find_element(*by("step-score-chart")).get_attribute("aria-label").startswith("step scores")
    assert "tree size" in driver.find_element(*by("search-summary")).text
    # a strategy that reads no verifier (majority, greedy) has null scores: "none", as the CLI says
    summary, score = driver.execute_script("""const box = renderSearch({answer: '4', score: null, n: 1,
        strategy: 'majority', tree_size: 1, verifier: null, chosen: 0,
        candidates: [{index: 0, answer: '4', score: null, text: 't'}]});
        return ['search-summary', 'candidate-score'].map((id) => box.querySelector(`[data-testid="${id}"]`).textContent)""")
    assert summary.startswith("answer 4 · score none · majority") and score == "score none"
    assert driver.find_element(*by("conversation-title")).get_attribute("value") == QUESTION[:60]
    # renamed with Enter (the field keeps the focus): it shows the title as stored, as the list does
    title = driver.find_element(*by("conversation-title"))
    for typed, stored in (("  my   search  ", "my search"), ("", "New chat")):
        title.send_keys(Keys.CONTROL, "a", Keys.NULL, Keys.BACKSPACE, typed, Keys.ENTER)  # (NULL lets Ctrl go)
        wait(driver, lambda d: title.get_attribute("value") == stored and stored in
             [i.text for i in d.find_elements(*by("conversation-item"))], timeout=10)
    driver.save_screenshot(str(shots / "chat-search.png"))

    # tools mode: the bundled router (treeserve chat's) picks SymPy, whose result is right
    new_chat(driver)
    driver.find_element(*by("mode-tools")).click()
    driver.find_element(*by("messages")).click()
    for question, _, _, result in (QUESTIONS[0], QUESTIONS[12], QUESTIONS[18]):
        send(driver, question)
        card = driver.find_elements(*by("tool-card"))[-1]
        assert card.find_element(*by("tool-name")).text == "tool: sympy", question
        assert card.find_element(*by("tool-result")).text == f"result: {result}", question
    driver.save_screenshot(str(shots / "chat-tools.png"))

    # an answer full of markup is shown as text and runs nothing
    new_chat(driver)
    driver.find_element(*by("mode-chat")).click()
    Select(driver.find_element(*by("settings-model"))).select_by_value("echo")
    driver.find_element(*by("messages")).click()
    send(driver, HOSTILE)
    assert last_answer(driver) == HOSTILE
    ActionChains(driver).move_to_element(driver.find_elements(*by("message-assistant"))[-1]).perform()
    time.sleep(0.3)
    assert driver.execute_script("return window.__xss") is None
    assert driver.execute_script("return document.querySelectorAll('#messages img, #messages script, #messages b')"
                                 ".length") == 0

    # Markdown is rendered by building elements, never by parsing the model's text as HTML
    send(driver, "**bold** and `code`\n\n- one\n- two\n\n```\n<b>print(1)</b>\n```\n"
                 "[safe](https://example.com/a) [bad](javascript:alert(1))")
    content = driver.find_elements(*by("message-assistant"))[-1].find_element(*by("message-content"))
    assert content.find_element("css selector", "strong").text == "bold"
    assert [li.text for li in content.find_elements("css selector", "li")] == ["one", "two"]
    assert content.find_element("css selector", "pre code").text == "<b>print(1)</b>"
    links = content.find_elements("css selector", "a")
    assert [(a.text, a.get_attribute("href")) for a in links] == [("safe", "https://example.com/a")]
    assert "[bad](javascript:alert(1))" in content.text

    # Stop: the answer stops growing, what was written is kept, the model's stream is cut off
    scripted = stack[2]
    finished = scripted.state.finished
    driver.find_element(*by("message-input")).send_keys("slowly: " + "one two three four five six " * 6)
    driver.find_element(*by("send")).click()
    wait(driver, lambda d: len(d.find_elements("css selector", '.message.streaming [data-testid="message-content"]'))
         and len(d.find_element("css selector", '.message.streaming [data-testid="message-content"]').text) > 12)
    driver.find_element(*by("stop")).click()
    wait(driver, lambda d: not d.find_elements("css selector", ".message.streaming"))
    stopped = driver.find_elements(*by("message-assistant"))[-1]  # shown finished: Markdown, no "…" header
    assert stopped.find_elements("css selector", ".content.markdown") and "stopped" in stopped.text
    assert not stopped.find_element("css selector", ".meta").text.endswith("…")
    partial = last_answer(driver)
    assert 12 <= len(partial) < len("slowly: " + "one two three four five six " * 6)
    driver.refresh()
    stopped = wait(driver, lambda d: d.find_elements(*by("message-assistant")))[-1]
    assert stopped.find_element(*by("message-content")).text.startswith(partial[:12]) and "stopped" in stopped.text
    time.sleep(1.5)
    assert scripted.state.finished == finished  # its stream never ran to the end

    # deleting the conversation an answer streams into stops the answer: Send is free again at once
    # (it used to stay disabled, the model writing on, until the whole answer was done)
    echo_url = driver.current_url
    driver.find_element(*by("message-input")).send_keys("slowly: " + "seven eight nine ten " * 12)
    driver.find_element(*by("send")).click()
    wait(driver, lambda d: d.find_elements("css selector", ".message.streaming"))
    driver.find_element(*by("delete-chat")).click()
    driver.switch_to.alert.accept()
    wait(driver, lambda d: d.current_url.endswith("/chat") and d.find_element(*by("send")).is_enabled()
         and not d.find_elements(*by("message-assistant")), timeout=3)
    listed = driver.execute_async_script("""fetch('/chat/api/conversations').then((r) => r.json())
        .then((body) => arguments[0](body.conversations.map((c) => c.id)))""")
    assert echo_url.rsplit("/", 1)[1] not in listed and conversation_id in listed
    time.sleep(1.5)
    assert scripted.state.finished == finished

    # a phone's width: one column, nothing wider than the screen; the conversations open from ☰
    driver.set_window_size(390, 844)
    wait(driver, lambda d: d.find_element(*by("toggle-sidebar")).is_displayed())
    assert driver.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    assert not driver.find_element(*by("new-chat")).is_displayed()
    toggle = driver.find_element(*by("toggle-sidebar"))
    toggle.click()
    wait(driver, lambda d: d.find_element(*by("new-chat")).is_displayed() and toggle.get_attribute("aria-expanded") == "true")
    driver.find_element("tag name", "body").send_keys(Keys.ESCAPE)  # (the open list covers the ☰ itself)
    wait(driver, lambda d: not d.find_element(*by("new-chat")).is_displayed())
    toggle.click()
    driver.find_element("css selector", f'[data-testid="conversation-item"][data-id="{conversation_id}"]').click()
    wait(driver, lambda d: d.current_url == conversation_url and not d.find_element(*by("new-chat")).is_displayed())
    assert driver.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    driver.set_window_size(1280, 900)

    # signed out in another tab: Send shows the sign-in form, the messages gone; so does Sign out
    def end_session():
        driver.execute_async_script("""const done = arguments[0];
            fetch('/chat/api/logout', {method: 'POST', headers: {'X-CSRF-Token': state.csrf}}).then(() => done());""")
    end_session()
    driver.find_element(*by("message-input")).send_keys("anyone there?")
    driver.find_element(*by("send")).click()
    wait(driver, lambda d: d.find_element(*by("login-username")).is_displayed())
    assert "session ended" in driver.find_element(*by("login-error")).text
    assert not driver.find_elements(*by("message-user")) and not driver.find_elements(*by("conversation-item"))
    sign_in(driver, url, "ada", "correct horse battery")
    end_session()
    driver.find_element(*by("sign-out")).click()
    wait(driver, lambda d: d.find_element(*by("login-username")).is_displayed())

    # another user cannot open this conversation
    sign_in(driver, url, "bob", "another long password")
    driver.get(conversation_url)
    notice = wait(driver, lambda d: d.find_element(*by("notice")) if d.find_element(*by("notice")).is_displayed()
                  else None)
    assert notice.text == "This conversation does not exist."
    assert driver.find_elements(*by("message-user")) == [] and driver.find_elements(*by("conversation-item")) == []

    # the page threw nothing and its Content-Security-Policy refused nothing, all along
    console = [entry["message"] for entry in driver.get_log("browser")]
    assert not [m for m in console if "Uncaught" in m or "Content Security Policy" in m or "Refused" in m], console
    # the 401 before signing in; 404; the 401s after the session ended
    expected = ("/chat/api/me - ", f"/chat/api/conversations/{conversation_id} - ", "/messages - ", "/chat/api/logout - ")
    assert not [m for m in console if "Failed to load resource" in m and not any(e in m for e in expected)], console


def test_a_rename_answered_after_another_conversation_opened_leaves_that_one_open(stack, browser):
    """Leaving the title field for another conversation in the list renames the first one (a change
    event); its PATCH answered once the other is open, the page showed the other's messages under the
    first one's id and title, and the next message went to the first one."""
    url, driver = stack[0], browser
    _signed_in_afresh(driver, url)
    opened = driver.execute_async_script("""const done = arguments[0];
        (async () => {
          const [a, b] = [await api("POST", "/chat/api/conversations", {}), await api("POST", "/chat/api/conversations", {})];
          await api("PATCH", `/chat/api/conversations/${b.id}`, {title: "chat B"});
          await openConversation(a.id);
          const realFetch = window.fetch;  // (a slow PATCH: answered after the other conversation opened)
          window.fetch = async (path, init) => {
            const response = await realFetch(path, init);
            if (init && init.method === "PATCH") await new Promise((resolve) => setTimeout(resolve, 500));
            return response;
          };
          $("title").value = "chat A";
          const renaming = renameConversation();
          await openConversation(b.id);
          await renaming;
          window.fetch = realFetch;
          const stored = await api("GET", `/chat/api/conversations/${a.id}`);
          done({open: state.conversation.id === b.id, title: $("title").value, stored: stored.title});
        })().catch((error) => done(String(error)));""")
    assert opened == {"open": True, "title": "chat B", "stored": "chat A"}


def _signed_in_afresh(driver, url: str) -> None:
    """The chat page signed in as ada, whoever was signed in before."""
    driver.get(url + "/chat")
    wait(driver, lambda d: d.find_element(*by("login-username")).is_displayed()
         or d.find_element(*by("new-chat")).is_displayed())
    if driver.find_element(*by("new-chat")).is_displayed():
        driver.find_element(*by("sign-out")).click()
    sign_in(driver, url, "ada", "correct horse battery")


def _two_echo_conversations(driver, url: str) -> tuple[str, str]:
    """Signed in as ada afresh, two new conversations answered by the scripted echo model."""
    _signed_in_afresh(driver, url)
    return tuple(driver.execute_async_script("""const done = arguments[0];
        (async () => {
          const body = {settings: {model: "echo", mode: "chat"}};
          const [a, b] = [await api("POST", "/chat/api/conversations", body),
                          await api("POST", "/chat/api/conversations", body)];
          done([a.id, b.id]);
        })().catch((error) => done(String(error)));"""))


def _open(driver, conversation_id: str) -> None:
    driver.find_element("css selector", f'[data-testid="conversation-item"][data-id="{conversation_id}"]').click()
    wait(driver, lambda d: d.current_url.endswith(f"/c/{conversation_id}"))


def test_an_answer_streams_on_in_its_conversation_while_another_is_used(stack, browser):
    """As in ChatGPT: another conversation opened while an answer streams is usable at once, and the
    answer goes on into its own conversation, shown there when it is opened again (Send stayed
    disabled in every conversation until the answer had ended)."""
    url, driver = stack[0], browser
    first, second = _two_echo_conversations(driver, url)
    driver.get(f"{url}/chat/c/{first}")
    wait(driver, lambda d: d.find_element(*by("send")).is_enabled())
    slow = "slowly: " + " ".join(["alpha beta gamma delta"] * 12)
    driver.find_element(*by("message-input")).send_keys(slow)
    driver.find_element(*by("send")).click()
    wait(driver, lambda d: len(d.find_elements("css selector", ".message.streaming .content")) and
         len(d.find_element("css selector", ".message.streaming .content").text) > 6)
    _open(driver, second)
    wait(driver, lambda d: d.find_element(*by("send")).is_enabled() and not d.find_element(*by("stop")).is_enabled()
         and not d.find_elements(*by("message-user")), timeout=5)
    send(driver, "hello there")
    assert last_answer(driver) == "hello there" and len(driver.find_elements(*by("message-user"))) == 1
    _open(driver, first)  # still streaming: shown under its question, Send waiting and Stop stopping it
    wait(driver, lambda d: d.find_elements("css selector", ".message.streaming")
         and not d.find_element(*by("send")).is_enabled() and d.find_element(*by("stop")).is_enabled(), timeout=5)
    assert [m.text for m in driver.find_elements(*by("message-user"))] == ["You\n" + slow]
    wait(driver, lambda d: not d.find_elements("css selector", ".message.streaming")
         and d.find_element(*by("send")).is_enabled(), timeout=60)
    assert last_answer(driver) == slow and len(driver.find_elements(*by("message-assistant"))) == 1


def test_stop_before_the_question_is_stored_back_shows_what_was_stored(stack, browser):
    """Stop pressed after the gateway took the message but before its stored copy came back: the
    page showed nothing of it (not the question, not the stopped answer) until a reload."""
    url, driver = stack[0], browser
    first, _ = _two_echo_conversations(driver, url)
    driver.get(f"{url}/chat/c/{first}")
    wait(driver, lambda d: d.find_element(*by("send")).is_enabled())
    driver.execute_script("""const realFetch = window.fetch;  // (the answer's events held back a while)
        window.fetch = async (path, init) => {
          const response = await realFetch(path, init);
          if (init && init.method === "POST" && String(path).endsWith("/messages")) {
            window.__taken = true;
            await new Promise((resolve) => setTimeout(resolve, 1500));
            window.fetch = realFetch;
          }
          return response;
        };""")
    driver.find_element(*by("message-input")).send_keys("slowly: stopped early")
    driver.find_element(*by("send")).click()
    wait(driver, lambda d: d.execute_script("return window.__taken === true"), timeout=10)
    driver.find_element(*by("stop")).click()
    wait(driver, lambda d: [m.text for m in d.find_elements(*by("message-user"))] == ["You\nslowly: stopped early"]
         and "stopped" in d.find_elements(*by("message-assistant"))[-1].text, timeout=10)
    assert driver.find_element(*by("send")).is_enabled()


def _messages(driver) -> list[tuple[str, str]]:
    """The conversation as the page shows it: (role, text) of each message, read at one instant."""
    return [tuple(m) for m in driver.execute_script("""return [...document.querySelectorAll('#messages .message')]
        .map((m) => [m.dataset.testid.replace('message-', ''),
                     m.querySelector('[data-testid="message-content"]').innerText.trim()]);""")]


def _stored(driver, conversation_id: str) -> list[tuple[str, str, str]]:
    """The conversation as the gateway stored it: (role, content, model) of each message."""
    return [tuple(m) for m in driver.execute_async_script("""const [id, done] = arguments;  // (the callback is last)
        api("GET", `/chat/api/conversations/${id}`)
          .then((c) => done(c.messages.map((m) => [m.role, m.content, m.model])));""", conversation_id)]


def _edit(driver, position: int, text: str) -> None:
    """The user's message at `position` edited to `text` and sent (Edit shows under the pointer)."""
    message = driver.find_elements(*by("message-user"))[position]
    ActionChains(driver).move_to_element(message).perform()
    message.find_element(*by("edit-message")).click()
    editor = wait(driver, lambda d: message.find_element(*by("edit-input")))
    editor.clear()
    driver.execute_script("arguments[0].value = arguments[1]", editor, text)  # (pasted: it may hold new lines)
    message.find_element(*by("edit-send")).click()


def test_regenerate_and_edit_replace_answers_and_keep_them(stack, browser):
    """Regenerate replaces the last answer (stopping one that streams first), Edit sends a message again
    with what followed it replaced; a reload shows both as stored, and what is edited runs nothing."""
    url, _, scripted = stack
    driver = browser
    first, _ = _two_echo_conversations(driver, url)
    driver.get(f"{url}/chat/c/{first}")
    wait(driver, lambda d: d.find_element(*by("send")).is_enabled())
    assert not driver.find_element(*by("regenerate")).is_enabled()  # nothing to answer again yet
    send(driver, "first question")
    send(driver, "second question")
    assert driver.find_element(*by("regenerate")).is_enabled()

    # Regenerate with another model: the last answer is replaced, the earlier turns stay
    Select(driver.find_element(*by("settings-model"))).select_by_value("arith-gen")
    set_field(driver, "settings-max-tokens", "8")
    asked = len(scripted.state.requests)
    driver.find_element(*by("regenerate")).click()
    # (the answer streaming is looked for last: before its stored question came back, there was none)
    wait(driver, lambda d: "arith-gen" in d.find_elements(*by("message-assistant"))[-1].find_element(
        "css selector", ".meta").text and not d.find_elements("css selector", ".message.streaming"), timeout=120)
    shown = _messages(driver)
    assert [role for role, _ in shown] == ["user", "assistant", "user", "assistant"]
    assert shown[:3] == [("user", "first question"), ("assistant", "first question"), ("user", "second question")]
    stored = _stored(driver, first)
    assert [(r, c) for r, c, _ in stored[:3]] == shown[:3] and stored[3][2] == "arith-gen"
    assert len(scripted.state.requests) == asked  # answered by arith-gen, not the echo model again
    driver.refresh()
    wait(driver, lambda d: len(d.find_elements(*by("message-assistant"))) == 2)
    assert "arith-gen" in driver.find_elements(*by("message-assistant"))[-1].find_element("css selector", ".meta").text

    # Regenerate while an answer streams: it is stopped first, and only the new answer is kept
    Select(driver.find_element(*by("settings-model"))).select_by_value("echo")
    driver.find_element(*by("messages")).click()
    slow = "slowly: " + " ".join(["one two three"] * 4)
    stopped = stopped_answers(url)
    driver.find_element(*by("message-input")).send_keys(slow)
    driver.find_element(*by("send")).click()
    wait(driver, lambda d: len(d.find_elements("css selector", ".message.streaming .content")) and
         len(d.find_element("css selector", ".message.streaming .content").text) > 6)
    driver.find_element(*by("regenerate")).click()
    wait(driver, lambda d: len(d.find_elements(*by("message-assistant"))) == 3 and last_answer(d) == slow
         and not d.find_elements("css selector", ".message.streaming"), timeout=60)
    assert wait(driver, lambda d: stopped_answers(url) == stopped + 1, timeout=10)  # the first one was stopped
    expected = [("user", "first question"), ("assistant", "first question"), ("user", "second question"),
                ("user", slow), ("assistant", slow)]
    shown = _messages(driver)
    assert [m for i, m in enumerate(shown) if i != 3] == expected and "stopped" not in driver.find_element(
        *by("messages")).text
    stored = _stored(driver, first)  # (the arith-gen answer at 3, kept)
    assert len(stored) == 6 and [(r, c) for i, (r, c, _) in enumerate(stored) if i != 3] == expected, stored

    # Edit the second question: it and everything after it are replaced; Cancel leaves the message as it was
    message = driver.find_elements(*by("message-user"))[1]
    ActionChains(driver).move_to_element(message).perform()
    message.find_element(*by("edit-message")).click()
    assert message.find_element(*by("edit-input")).get_attribute("value") == "second question"
    message.find_element(*by("edit-cancel")).click()
    assert not message.find_elements(*by("edit-input")) and message.find_element(*by("message-content")).text \
        == "second question"
    _edit(driver, 1, "second, edited")
    wait(driver, lambda d: _messages(d) == [("user", "first question"), ("assistant", "first question"),
                                            ("user", "second, edited"), ("assistant", "second, edited")], timeout=60)
    assert [m["content"] for m in scripted.state.requests[-1]["messages"]] == ["first question", "first question",
                                                                             "second, edited"]
    driver.refresh()
    wait(driver, lambda d: _messages(d) == [("user", "first question"), ("assistant", "first question"),
                                            ("user", "second, edited"), ("assistant", "second, edited")])

    # an edit full of markup is shown as text, in the page and in the editor, and runs nothing
    _edit(driver, 0, HOSTILE)
    wait(driver, lambda d: _messages(d) == [("user", HOSTILE), ("assistant", HOSTILE)], timeout=60)
    message = driver.find_elements(*by("message-user"))[0]
    ActionChains(driver).move_to_element(message).perform()
    message.find_element(*by("edit-message")).click()
    assert message.find_element(*by("edit-input")).get_attribute("value") == HOSTILE
    message.find_element(*by("edit-cancel")).click()
    time.sleep(0.3)
    assert driver.execute_script("return window.__xss") is None
    assert driver.execute_script("return document.querySelectorAll('#messages img, #messages script, #messages b')"
                                 ".length") == 0

    # another user reaches neither route for this conversation (the server's answer, whatever the page shows)
    driver.find_element(*by("sign-out")).click()
    sign_in(driver, url, "bob", "another long password")
    refused = driver.execute_async_script("""const [id, done] = arguments;
        (async () => {
          const regenerate = await fetch(`/chat/api/conversations/${id}/regenerate`, {method: "POST",
            headers: {"Content-Type": "application/json", "X-CSRF-Token": state.csrf}, body: "{}"});
          const edit = await fetch(`/chat/api/conversations/${id}/messages/1`, {method: "PUT",
            headers: {"Content-Type": "application/json", "X-CSRF-Token": state.csrf}, body: '{"content": "x"}'});
          done([regenerate.status, edit.status]);
        })();""", first)
    assert refused == [404, 404]
    _signed_in_afresh(driver, url)
    assert [(r, c) for r, c, _ in _stored(driver, first)] == [("user", HOSTILE), ("assistant", HOSTILE)]


def test_an_edit_the_gateway_refuses_keeps_what_was_typed(stack, browser):
    """An edit refused (here a 422: longer than a message may be) closed its editor before it was sent:
    the page showed the old message again and what was typed was gone. As a refused new message stays
    in the box, the editor stays open with the text until the gateway takes the edit."""
    url, driver = stack[0], browser
    first, _ = _two_echo_conversations(driver, url)
    driver.get(f"{url}/chat/c/{first}")
    wait(driver, lambda d: d.find_element(*by("send")).is_enabled())
    send(driver, "a question")
    too_long = "x" * 32001
    _edit(driver, 0, too_long)
    wait(driver, lambda d: d.find_element(*by("notice")).is_displayed(), timeout=10)
    message = driver.find_elements(*by("message-user"))[0]
    assert message.find_element(*by("edit-input")).get_attribute("value") == too_long
    assert message.find_element(*by("edit-send")).is_enabled()
    assert _stored(driver, first) == [("user", "a question", "echo"), ("assistant", "a question", "echo")]
    _edit(driver, 0, "a question, shortened")  # (sent from the editor still open)
    wait(driver, lambda d: _messages(d) == [("user", "a question, shortened"), ("assistant", "a question, shortened")],
         timeout=60)
    assert not driver.find_elements(*by("edit-input"))


def test_an_edit_refused_after_it_stopped_an_answer_shows_that_answer(stack, browser):
    """Edit (or Regenerate) stops an answer streaming first; refused by the gateway, nothing replaced
    that answer, yet the page left it off (the question unanswered until a reload). It is shown
    stopped, as Stop shows it, and as stored."""
    url, driver = stack[0], browser
    first, _ = _two_echo_conversations(driver, url)
    driver.get(f"{url}/chat/c/{first}")
    wait(driver, lambda d: d.find_element(*by("send")).is_enabled())
    send(driver, "a question")
    slow = "slowly: " + " ".join(["one two three"] * 20)  # (long: still streaming when it is edited, under load)
    driver.find_element(*by("message-input")).send_keys(slow)
    driver.find_element(*by("send")).click()
    wait(driver, lambda d: len(d.find_elements("css selector", ".message.streaming .content")) and
         len(d.find_element("css selector", ".message.streaming .content").text) > 6)
    _edit(driver, 0, "x" * 32001)  # (refused: longer than a message may be)
    wait(driver, lambda d: len(d.find_elements(*by("message-assistant"))) == 2  # (the wait's default: a
         and "stopped" in d.find_elements(*by("message-assistant"))[-1].text)  # loaded CI took over 10 s)
    shown = _messages(driver)
    assert shown[:3] == [("user", "a question"), ("assistant", "a question"), ("user", slow)]
    assert shown[3][0] == "assistant" and slow.startswith(shown[3][1]) and shown[3][1]
    assert driver.find_elements(*by("message-user"))[0].find_element(*by("edit-input")).get_attribute("value") \
        == "x" * 32001
    assert driver.find_element(*by("send")).is_enabled() and not driver.find_element(*by("stop")).is_enabled()


def test_a_regeneration_the_model_server_refuses_keeps_the_old_answer(stack, browser):
    """Regenerate while the model's server refuses new requests (its queue full): the old answer stays
    on the page and as stored, and the refusal is shown (was: the old answer deleted, an empty failed
    answer in its place)."""
    url, _, scripted = stack
    driver = browser
    first, _ = _two_echo_conversations(driver, url)
    driver.get(f"{url}/chat/c/{first}")
    wait(driver, lambda d: d.find_element(*by("send")).is_enabled())
    send(driver, "a question")
    scripted.state.queue_full = True
    try:
        driver.find_element(*by("regenerate")).click()
        notice = wait(driver, lambda d: d.find_element(*by("notice")) if d.find_element(*by("notice")).is_displayed()
                      else None, timeout=30)
        assert "requests are waiting" in notice.text
    finally:
        scripted.state.queue_full = False
    assert _messages(driver) == [("user", "a question"), ("assistant", "a question")]
    assert _stored(driver, first) == [("user", "a question", "echo"), ("assistant", "a question", "echo")]
    assert driver.find_element(*by("send")).is_enabled() and driver.find_element(*by("regenerate")).is_enabled()
